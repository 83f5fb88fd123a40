"""LoRA adapters an engine serves beside its base model (issue 30). A line or an online request names one by its
`model`, as `vllm serve` takes them; vLLM picks the adapter by that name, so vbatch only needs to know which names
exist and the base model each applies to: a batch may mix a base model and its adapters."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass


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
