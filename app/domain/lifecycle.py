"""A batch's lifecycle: its statuses, which of them are active or final, and the moves between them."""

from __future__ import annotations

from enum import StrEnum


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


TRANSITIONS: dict[BatchStatus, frozenset[BatchStatus]] = {
    BatchStatus.VALIDATING: frozenset(
        {BatchStatus.IN_PROGRESS, BatchStatus.FAILED, BatchStatus.CANCELLING, BatchStatus.EXPIRED}
    ),
    BatchStatus.IN_PROGRESS: frozenset(
        {BatchStatus.FINALIZING, BatchStatus.CANCELLING, BatchStatus.EXPIRED, BatchStatus.FAILED}
    ),
    BatchStatus.FINALIZING: frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED}),
    BatchStatus.CANCELLING: frozenset({BatchStatus.CANCELLED}),
    BatchStatus.COMPLETED: frozenset(),
    BatchStatus.FAILED: frozenset(),
    BatchStatus.EXPIRED: frozenset(),
    BatchStatus.CANCELLED: frozenset(),
}
TERMINAL = frozenset(status for status, moves in TRANSITIONS.items() if not moves)
# The engine loop owns these: it picks them up in creation order, after a restart too.
ACTIVE = frozenset(BatchStatus) - TERMINAL


class InvalidTransition(Exception):
    pass


def check_move(current: BatchStatus, to: BatchStatus) -> None:
    if to not in TRANSITIONS[current]:
        raise InvalidTransition(f"{current} -> {to}")
