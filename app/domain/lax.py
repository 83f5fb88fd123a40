"""A request body's values as vLLM's request models read them: pydantic's lax mode, which takes `"700"` and `700.0`
for an `int`, and `"true"` or `1` for a `bool`. Whatever vbatch decides from a body before the engine has parsed it
(a charge, a bound, a stream) reads it the same way, so that no spelling the engine accepts slips past it."""

from __future__ import annotations

from pydantic import TypeAdapter, ValidationError

# Past any real request's size: a number that asks for more is taken as this much, not an overflowing one.
MOST = 10**9

_INT: TypeAdapter[int | None] = TypeAdapter(int | None)
_BOOL: TypeAdapter[bool | None] = TypeAdapter(bool | None)


def whole_number(value: object) -> int | None:
    """`value` as a field `int | None` takes it, kept within 0 and `MOST`; None for what such a field refuses or
    leaves unset."""
    try:
        number = _INT.validate_python(value)
    except ValidationError:
        return None
    return None if number is None else max(0, min(number, MOST))


def flag(value: object) -> bool:
    """`value` as a field `bool | None` takes it; False for what it refuses or leaves unset."""
    try:
        return bool(_BOOL.validate_python(value))
    except ValidationError:
        return False
