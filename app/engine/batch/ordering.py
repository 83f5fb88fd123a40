"""Prefix-aware feeding: lines that open with the same long text (instructions, few-shot examples) are sent to
the engine one after another, so the shared prefix is computed once and the rest of its group finds it in vLLM's
prefix cache. In a shuffled file whose distinct prefixes outgrow the cache, the engine would otherwise evict a
prefix between two of its lines and compute it again (docs/benchmarks.md, "prefixes that outgrow the cache").

No warm-up request leads a group: measured on vLLM 0.26, lines of a group sent together already reach the
cache-hit ceiling, and awaiting a warm-up stalled the feed once per group.

With several data-parallel ranks, each shared-prefix group is pinned to one rank (`pin_to_ranks`), so the rank
that computed its prefix serves the rest of it from its own cache; lines without a shared prefix are left to the
engine's own balancing.

A file may name many LoRA adapters, in any order. vLLM runs lines of at most `--max-loras` adapters in a step
(vllm 0.32, `vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule`: a waiting request whose LoRA is not among
`scheduled_loras` once `len(scheduled_loras) == self.lora_config.max_loras` is skipped, "Scheduling would exceed
max_loras, skip"), so lines of other adapters sent meanwhile sit in its queue holding batch slots, and each switch
loads an adapter into a GPU slot again. So the plan puts each adapter's lines together, and the feed lets lines of
at most `max_loras` adapters in at once (`AdapterGate`); the next adapter's first line waits for one of them to
have none left in flight. Lines of the base model take no LoRA slot and never wait.

Planning reads only the input index (`app.domain.input_index`): the digests and adapters validation recorded, not
the file.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from app.domain.input_index import InputIndex

MIN_GROUP = 2


@dataclass
class Group:
    shared_prefix: bool
    positions: array = field(default_factory=lambda: array("q"))  # positions in the input index
    rank: int | None = None  # the data-parallel rank its lines run on (None: any)
    adapter: int = 0  # the LoRA adapter its lines name, by its number in the index (0: the base model)


def plan(index: InputIndex) -> list[Group]:
    """The lines adapter by adapter, the base model's being one more, in order of first appearance; within each,
    groups in order of first appearance: a shared-prefix group holds every line of the adapter with that prefix;
    lines without one (or whose prefix no other of its lines shares) keep their own order between the groups. A
    prefix is shared within an adapter only: vLLM's prefix cache keys a block by its LoRA too
    (`vllm/v1/core/kv_cache_utils.py`, `_gen_lora_extra_hash_keys`)."""
    if not index.adapter_count:
        return _prefix_groups(index, range(len(index)), adapter=0)
    by_adapter: dict[int, array] = {}
    for position, adapter in enumerate(index.adapter_numbers):
        by_adapter.setdefault(adapter, array("q")).append(position)
    return [group for adapter, positions in by_adapter.items() for group in _prefix_groups(index, positions, adapter)]


def _prefix_groups(index: InputIndex, positions: Sequence[int], adapter: int) -> list[Group]:
    by_digest: dict[bytes, Group] = {}
    for position in positions:
        digest = index.digest(position)
        if digest is not None:
            by_digest.setdefault(digest, Group(shared_prefix=True, adapter=adapter)).positions.append(position)
    groups: list[Group] = []
    for position in positions:
        digest = index.digest(position)
        group = by_digest.get(digest) if digest is not None else None
        if group is not None and len(group.positions) >= MIN_GROUP:
            if group.positions[0] == position:
                groups.append(group)
            continue
        if not groups or groups[-1].shared_prefix:
            groups.append(Group(shared_prefix=False, adapter=adapter))
        groups[-1].positions.append(position)
    return groups


def pin_to_ranks(groups: list[Group], ranks: int) -> None:
    """Each shared-prefix group to one rank, the largest first, each to the rank with the fewest lines so far."""
    if ranks <= 1:
        return
    load = [0] * ranks
    for group in sorted((g for g in groups if g.shared_prefix), key=lambda g: -len(g.positions)):
        rank = load.index(min(load))
        group.rank = rank
        load[rank] += len(group.positions)


async def ordered_lines(
    path: Path, index: InputIndex, groups: list[Group], *, skip: Collection[int]
) -> AsyncIterator[tuple[int, dict, int | None]]:
    """(position, request, rank) in planned order, each read by its offset, leaving out the positions in `skip`."""
    planned = ((position, group.rank) for group in groups for position in group.positions if position not in skip)
    with path.open("rb") as src:
        for position, rank in planned:
            yield position, index.read(src, position), rank


class AdapterGate:
    """Lets lines of at most `max_loras` LoRA adapters in at once (`app.engine.sharing.execution.Gate`). Counted over
    all data-parallel ranks: lines the engine balances spread an adapter over every rank, so no rank holds more."""

    def __init__(self, index: InputIndex, max_loras: int) -> None:
        self._adapter_of = index.adapter_numbers
        self._max_loras = max_loras
        self._in_flight: dict[int, int] = {}  # adapter number -> its lines let in and not yet answered
        self._open = asyncio.Event()
        self._open.set()

    async def opened(self) -> None:
        await self._open.wait()

    def admit(self, position: int) -> bool:
        adapter = self._adapter_of[position]
        if not adapter:
            return True
        count = self._in_flight.get(adapter, 0)
        if not count and len(self._in_flight) >= self._max_loras:
            self._open.clear()
            return False
        self._in_flight[adapter] = count + 1
        return True

    def leave(self, position: int) -> None:
        adapter = self._adapter_of[position]
        if not adapter:
            return
        count = self._in_flight[adapter] - 1
        if count:
            self._in_flight[adapter] = count
        else:
            del self._in_flight[adapter]
            self._open.set()


def adapter_gate(index: InputIndex, max_loras: int | None) -> AdapterGate | None:
    """The gate a batch's feed needs: none when the engine serves no adapters or every adapter the file names fits
    its slots at once (nothing to wait for, and the feed keeps its plain path)."""
    if max_loras is None or index.adapter_count <= max_loras:
        return None
    return AdapterGate(index, max_loras)
