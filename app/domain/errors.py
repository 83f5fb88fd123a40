"""What the domain refuses, in its own terms (on `app.core.errors.DomainError`). `app.api.errors` alone turns these
into OpenAI's HTTP envelopes, so code that runs on the engine thread never builds an HTTP answer."""

from __future__ import annotations

from app.core.errors import DomainError


class InvalidRequest(DomainError):
    """The request cannot be carried out as asked; asking again unchanged will not help."""


class NotFound(DomainError):
    def __init__(self, kind: str, object_id: str, *, param: str | None = "id", code: str | None = None) -> None:
        super().__init__(f"No such {kind} object: {object_id}", param=param, code=code)


class NotCancellable(InvalidRequest):
    def __init__(self, status: str) -> None:
        super().__init__(
            f"Cannot cancel a batch with status '{status}'.", param="batch_id", code="batch_not_cancellable"
        )


class Conflict(DomainError):
    """The object is not in a state that allows this (OpenAI's 409); it may be once the object has moved on."""


class NotEnded(Conflict):
    def __init__(self, batch_id: str, status: str) -> None:
        super().__init__(
            f"Batch {batch_id} is {status}: only an ended batch (completed, failed, expired or cancelled) can be "
            "retried. Cancel it, or wait for it to end.",
            param="batch_id",
            code="batch_not_ended",
        )


class TooManyActive(DomainError):
    """A quota that frees itself only as the caller's own batches end: a prompt retry cannot help."""

    retry_after_seconds = 60

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"This API key already has {limit} batches validating or running, the most allowed at once. "
            "Wait for one to finish, or cancel one.",
            code="too_many_active_batches",
        )


class ModelNotServed(DomainError):
    """A request names a model no engine here serves: OpenAI's 404 `model_not_found`."""

    def __init__(self, model: str) -> None:
        # Shown as sent, but as text any client can read back: a lone surrogate escaped, a long name cut.
        shown = model[:256].encode("utf-8", "backslashreplace").decode()
        super().__init__(
            f"The model `{shown}` does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )


class TooManyEstimates(DomainError):
    """Estimates already running, for this key or in all: each tokenizes and hashes a whole file, and more at once
    would slow every other request the service answers. One ends within seconds to a few minutes."""

    retry_after_seconds = 5

    def __init__(self, *, running: int, whose: str) -> None:
        super().__init__(
            f"{running} estimate(s) {whose} are running, the most allowed at once; try again when one has ended.",
            code="too_many_estimates",
        )
