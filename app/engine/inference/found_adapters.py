"""Adapters found by name at first use (`VBATCH_LORA_DIR`, `app.core.lora_dir`) as an engine checks them: against
its base model and its LoRA settings (`--enable-lora`, `--max-lora-rank`), read from its `engine_config`. Batch
validation (`app.engine.batch.intake`), the console's check of a file and the serving layer that loads an adapter
(`app.engine.inference.vllm_adapter`) all ask the same finder."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from app.core.lora_dir import LoraDir
from app.domain.adapters import Adapter, AdapterFinder

log = logging.getLogger("vbatch.engine")

# How long a name that is no adapter of this engine's base stays so, before its folder is looked at again.
RECHECK_SECONDS = 30.0


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


class ClaimableAdapters:
    """Adapters of `VBATCH_LORA_DIR` that unheld batches name and this engine could load: a worker beside others
    claims such a batch as it claims one for a model it serves, though it announces the adapter only once a batch
    has run on it. Only an adapter the finder accepts counts (of this base, within its rank): a batch for another
    base waits for its own worker. Adapters are taken not to change under their name, so one found stays found; a
    name that is not one is looked at again after RECHECK_SECONDS (the folder may have been added since)."""

    def __init__(self, finder: Callable[[], AdapterFinder | None], clock: Callable[[], float] = time.monotonic) -> None:
        self._finder = finder
        self._clock = clock
        self._found: set[str] = set()
        self._not_until: dict[str, float] = {}

    @property
    def looks_up(self) -> bool:
        """Whether there is a folder to look in and an engine to check against."""
        return self._finder() is not None

    def among(self, names: Sequence[str]) -> list[str]:
        """The names in `names` that are such adapters. Blocks (disk, object store): call it on a thread."""
        finder = self._finder()
        if finder is None:
            return []
        now = self._clock()
        for name in names:
            if name not in self._found and self._not_until.get(name, 0.0) <= now:
                self._look_up(finder, name, now)
        return [name for name in names if name in self._found]

    def _look_up(self, finder: AdapterFinder, name: str, now: float) -> None:
        try:
            found = finder(name)
        except Exception as exc:  # an object store that does not answer: the name is looked at again later
            log.warning("could not look up %r in VBATCH_LORA_DIR: %s", name, exc)
            found = None
        if isinstance(found, Adapter):
            self._found.add(name)
        else:
            self._not_until[name] = now + RECHECK_SECONDS
