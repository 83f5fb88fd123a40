"""Prefix-aware feeding: lines that open with the same long text (instructions, few-shot examples) are sent to
the engine one after another, so the shared prefix is computed once and the rest of its group finds it in vLLM's
prefix cache. In a shuffled file whose distinct prefixes outgrow the cache, the engine would otherwise evict a
prefix between two of its lines and compute it again (docs/benchmarks.md, "prefixes that outgrow the cache").

No warm-up request leads a group: measured on vLLM 0.26, lines of a group sent together already reach the
cache-hit ceiling, and awaiting a warm-up stalled the feed once per group.

With several data-parallel ranks, each shared-prefix group is pinned to one rank (`pin_to_ranks`), so the rank
that computed its prefix serves the rest of it from its own cache; lines without a shared prefix are left to the
engine's own balancing.

Planning reads only the input index (`app.domain.input_index`): the digests validation computed, not the file.
"""

from __future__ import annotations

from array import array
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from pathlib import Path

from app.domain.input_index import InputIndex

MIN_GROUP = 2


@dataclass
class Group:
    shared_prefix: bool
    positions: array = field(default_factory=lambda: array("q"))  # positions in the input index
    rank: int | None = None  # the data-parallel rank its lines run on (None: any)


def plan(index: InputIndex) -> list[Group]:
    """Groups in order of first appearance: a shared-prefix group holds every line with that prefix; lines
    without one (or whose prefix no other line shares) keep their own order between the groups."""
    by_digest: dict[bytes, Group] = {}
    for position in range(len(index)):
        digest = index.digest(position)
        if digest is not None:
            by_digest.setdefault(digest, Group(shared_prefix=True)).positions.append(position)
    groups: list[Group] = []
    for position in range(len(index)):
        digest = index.digest(position)
        group = by_digest.get(digest) if digest is not None else None
        if group is not None and len(group.positions) >= MIN_GROUP:
            if group.positions[0] == position:
                groups.append(group)
            continue
        if not groups or groups[-1].shared_prefix:
            groups.append(Group(shared_prefix=False))
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
