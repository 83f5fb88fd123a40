"""Adapters found by name at first use (`VBATCH_LORA_DIR`, `app.core.lora_dir`) as an engine checks them: against
its base model and its LoRA settings (`--enable-lora`, `--max-lora-rank`), read from its `engine_config`. Batch
validation (`app.engine.intake`), the console's check of a file and the serving layer that loads an adapter
(`app.engine.vllm_adapter`) all ask the same finder."""

from __future__ import annotations

from collections.abc import Mapping

from app.core.lora_dir import LoraDir
from app.domain.adapters import AdapterFinder


def adapter_finder(source: LoraDir | None, *, base: str, engine_config: Mapping[str, object]) -> AdapterFinder | None:
    """None without a `VBATCH_LORA_DIR`. An engine config without the LoRA settings (no engine yet) leaves the
    checks that need them to the engine's own validation."""
    if source is None:
        return None
    rank = engine_config.get("max_lora_rank")
    model = engine_config.get("model")
    return AdapterFinder(
        folder_of=source.folder,
        base=base,
        base_path=model if isinstance(model, str) else None,
        max_rank=rank if isinstance(rank, int) else None,
        lora_enabled=engine_config.get("enable_lora", True) is not False,
    )
