"""An estimate of a batch before it exists (`POST /v1/batches/estimate`, the console's submit page): the body checked
as creation checks it, the file validated as the batch's validation would, each line's prompt counted by the engine
(`EngineView.count_tokens`: off its loop, in front-end processes where there are several), and the arithmetic of
`app.domain.estimates` over them and the engine's history."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy.engine import Engine

from app.core.config import Settings
from app.core.lora_dir import lora_dir
from app.core.storage import Storage
from app.domain import batches, estimates
from app.domain.adapters import parents
from app.domain.online import EngineUnavailable
from app.domain.schemas import BatchErrors, BatchEstimate, CreateBatchRequest
from app.domain.validation import Limits, Report, validate_file
from app.engine.inference.found_adapters import adapter_finder
from app.engine.inference.serving import devices_of
from app.engine.online.view import EngineView

# The context vLLM gives a model when the engine does not say (its config always does; a fake may not).
DEFAULT_MAX_MODEL_LEN = 2048


def limits_for(settings: Settings, endpoint: str, engine: EngineView) -> Limits:
    """Validation's limits as the engine's would be. An API replica's engine view reads the served models from the
    workers' beats in the database; without an engine yet, the adapters' rank limit is unknown: the batch's own
    validation, on the engine, checks it."""
    served = engine.served_models
    found = adapter_finder(lora_dir(settings), base=served[0], engine_config=engine.engine_config) if served else None
    return Limits.from_settings(
        settings, endpoint=endpoint, served_models=served, parents=parents(engine.adapters), find_adapter=found
    )


def check_file(path: Path, settings: Settings, endpoint: str, engine: EngineView) -> Report:
    """Blocking: the file's one read, as the batch's validation reads it."""
    return validate_file(path, limits_for(settings, endpoint, engine))


async def estimate(
    *, db: Engine, storage: Storage, settings: Settings, engine: EngineView, request: CreateBatchRequest, owner: str
) -> BatchEstimate:
    batches.check_request(request, settings.allowed_windows)
    source = await asyncio.to_thread(batches.input_of, db=db, request=request, owner=owner)
    _check_up(engine)
    path = await storage.local_path(source.id)
    report = await asyncio.to_thread(check_file, path, settings, request.endpoint, engine)
    return await of_checked(
        db=db, settings=settings, engine=engine, endpoint=request.endpoint, file_id=source.id, path=path, report=report
    )


async def of_checked(
    *, db: Engine, settings: Settings, engine: EngineView, endpoint: str, file_id: str, path: Path, report: Report
) -> BatchEstimate:
    """The estimate of the file at `path` (`file_id`), once `check_file` has given its `report`."""
    _check_up(engine)
    # The model the batch would run on, as its validation names it (`app.engine.batch.intake`).
    model = report.model or (engine.served_models[0] if engine.served_models else None)
    asked = estimates.Asked(input_file_id=file_id, endpoint=endpoint, model=model)
    pricing = estimates.Pricing(gpus=devices_of(engine.engine_config), gpu_hour_price=settings.gpu_hour_price)
    if not report.ok:
        return estimates.refused(asked, report.total, BatchErrors(data=report.errors), pricing)
    bodies = await asyncio.to_thread(_bodies, report, path)
    counts = await engine.count_tokens(endpoint, bodies)
    max_model_len = engine.engine_config.get("max_model_len")
    context = max_model_len if isinstance(max_model_len, int) else DEFAULT_MAX_MODEL_LEN
    # Without counts (an API replica), each line's cap is taken as its limit or the whole context.
    capped = _lines(endpoint, bodies, counts or [None] * len(bodies), context)
    caps = [line.max_output_tokens for line in capped]
    history = await asyncio.to_thread(
        estimates.recent_history,
        db=db,
        model=model,
        endpoint=endpoint,
        lines=report.total,
        wave=_wave(engine),
        caps=caps,
    )
    lines = None if counts is None else capped
    return estimates.estimate(asked, report.total, lines, history, pricing, caps)


def _wave(engine: EngineView) -> int | None:
    """The requests the engine runs at once: `max_num_seqs` on each data-parallel rank (None: not known here)."""
    config = engine.engine_config
    seqs, ranks = config.get("max_num_seqs"), config.get("data_parallel_size", 1)
    return seqs * ranks if isinstance(seqs, int) and isinstance(ranks, int) else None


def _check_up(engine: EngineView) -> None:
    """Until an engine serves, the models a file may name are not known: its validation would be wrong."""
    if engine.state != "ok":
        raise EngineUnavailable(engine.state)


def _bodies(report: Report, path: Path) -> list[dict]:
    return [request["body"] for _, request in report.index.requests(path, range(len(report.index)))]


def _lines(
    endpoint: str, bodies: list[dict], counts: list[estimates.PromptCount | None], context: int
) -> list[estimates.Line]:
    """A line the tokenizer could not count (its handler would refuse it) counts no prompt tokens."""
    nothing = estimates.PromptCount(0)
    return [
        estimates.line_of(endpoint, body, count or nothing, context) for body, count in zip(bodies, counts, strict=True)
    ]
