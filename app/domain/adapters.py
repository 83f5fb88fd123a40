"""LoRA adapters an engine serves beside its base model (issue 30). A line or an online request names one by its
`model`, as `vllm serve` takes them; vLLM picks the adapter by that name, so vbatch only needs to know which names
exist and the base model each applies to: a batch may mix a base model and its adapters."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path, PurePath


@dataclass(frozen=True)
class Adapter:
    name: str
    parent: str  # the base model's served name
    root: str  # where the engine loaded it from: `vllm serve`'s /v1/models shows it as the card's `root`


def parents(adapters: Iterable[Adapter]) -> dict[str, str]:
    """Each adapter's base model, by the adapter's name."""
    return {adapter.name: adapter.parent for adapter in adapters}


def to_json(adapters: Iterable[Adapter]) -> str:
    return json.dumps([asdict(adapter) for adapter in adapters])


def from_json(text: str) -> list[Adapter]:
    return [Adapter(**fields) for fields in json.loads(text)]


class RecentMisses:
    """Names lately found to be no model here, so that a client naming one again and again costs no look-up each
    time (with an `s3://` VBATCH_LORA_DIR, a LIST of the store): each is looked at again after `seconds` (its folder
    may have been added since). At most `most` are kept, the oldest forgotten first. Safe from any thread."""

    def __init__(self, *, seconds: float = 30.0, most: int = 10_000, clock: Callable[[], float] = time.monotonic):
        self._seconds = seconds
        self._most = most
        self._clock = clock
        self._lock = threading.Lock()
        self._until: OrderedDict[str, float] = OrderedDict()

    def __contains__(self, name: str) -> bool:
        with self._lock:
            until = self._until.get(name)
            if until is not None and until <= self._clock():
                del self._until[name]
                return False
            return until is not None

    def add(self, name: str) -> None:
        with self._lock:
            self._until.pop(name, None)
            self._until[name] = self._clock() + self._seconds
            while len(self._until) > self._most:
                self._until.popitem(last=False)


@dataclass(frozen=True)
class AdapterProblem:
    """Why a folder of `VBATCH_LORA_DIR` named by a request cannot serve it: a per-line error at validation."""

    code: str
    message: str


@dataclass(frozen=True)
class AdapterFinder:
    """Adapters found by name at first use (`app.core.lora_dir`), checked as far as can be known before the engine
    loads one: its adapter_config.json, its base model, its rank. Calls block (disk, object store)."""

    folder_of: Callable[[str], Path | None]  # the local folder of the adapter with this name, None if there is none
    base: str  # the base model's served name: the adapter's `parent`
    base_path: str | None = None  # what the engine loaded it from (`--model`), when known
    # The engine's `--max-lora-rank`; None while unknown (no engine yet: the engine's own validation checks it).
    max_rank: int | None = None
    lora_enabled: bool = True  # False: the engine was started without `--enable-lora`

    def __call__(self, name: str) -> Adapter | AdapterProblem | None:
        """The adapter, why it cannot be used, or None when there is no adapter by that name."""
        folder = self.folder_of(name)
        if folder is None:
            return None
        if not self.lora_enabled:
            return AdapterProblem(
                "lora_not_enabled",
                f"The model {name!r} is a LoRA adapter, and the engine was started without --enable-lora.",
            )
        problem = self._problem(name, _adapter_config(folder))
        return problem or Adapter(name=name, parent=self.base, root=str(folder))

    def _problem(self, name: str, config: dict | None) -> AdapterProblem | None:
        rank = None if config is None else config.get("r")
        if config is None or isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            return AdapterProblem(
                "invalid_adapter",
                f"The model {name!r} is not a LoRA adapter: its folder has no readable "
                "adapter_config.json with a rank 'r'.",
            )
        base = config.get("base_model_name_or_path")
        if base and not self._is_base(str(base)):
            return AdapterProblem(
                "adapter_base_mismatch",
                f"The model {name!r} is an adapter of another base model ({str(base)[:200]!r}), not of {self.base!r}.",
            )
        if self.max_rank is not None and rank > self.max_rank:
            return AdapterProblem(
                "adapter_rank_too_large",
                f"The adapter {name!r} has rank {rank}, above the engine's --max-lora-rank {self.max_rank}.",
            )
        return None

    def _is_base(self, named: str) -> bool:
        """As lenient as vLLM, which loads an adapter whatever base it names: a hub id, a local path or the served
        name all match when they end in the same final component (`HuggingFaceTB/SmolLM2-135M-Instruct` and
        `/models/SmolLM2-135M-Instruct`)."""
        ours = {self.base, *([self.base_path] if self.base_path else [])}
        finals = {_final(name) for name in ours}
        return named in ours or _final(named) in finals


def _final(path: str) -> str:
    return PurePath(path.rstrip("/")).name.lower()


def _adapter_config(folder: Path) -> dict | None:
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
