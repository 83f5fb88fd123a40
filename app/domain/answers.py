"""An online answer made OpenAI's on its way to the client, where vLLM's serving layer words it otherwise:

- `service_tier` says the tier the request was served on ("default" for "auto" or none asked), in chat completions
  and responses, streamed or not (vLLM says null, or "auto");
- a stream whose client asked `stream_options.include_usage` has `"usage": null` on every chunk before the one that
  carries it, as OpenAI's have; one whose client did not ask carries no usage, although vbatch always asks the
  engine for it (`app.domain.online.as_online`: what a stream generated is charged from it).

Events are rewritten only where one of these applies; an error event and `[DONE]` pass as they came.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from app.domain.lax import flag
from app.domain.online import USAGE_ON_ASKING, served_tier

_DATA = b"data: "
_TIERED = ("/v1/chat/completions", "/v1/responses")


@dataclass(frozen=True)
class AnswerWording:
    endpoint: str
    service_tier: str | None  # the tier echoed (None: the endpoint's answers have no such field)
    usage_asked: bool  # the client's own `stream_options.include_usage`

    @classmethod
    def of(cls, endpoint: str, body: dict) -> AnswerWording:
        options = body.get("stream_options")
        asked = isinstance(options, dict) and flag(options.get("include_usage"))
        return cls(endpoint, served_tier(body) if endpoint in _TIERED else None, asked)

    def body(self, body: dict) -> dict:
        """A JSON answer's body, its tier echoed (an error's left as it is)."""
        if self.service_tier is not None and "error" not in body:
            return {**body, "service_tier": self.service_tier}
        return body

    def events(self, chunk: bytes) -> bytes:
        """A stream's bytes of one or more whole events, reworded; b"" when none of them is the client's."""
        if not self._may_change(chunk):
            return chunk
        return b"".join(self._event(event) for event in chunk.split(b"\n\n") if event)

    def _may_change(self, chunk: bytes) -> bool:
        if self.endpoint == "/v1/responses":
            return b'"response":' in chunk
        return self.endpoint in USAGE_ON_ASKING and (
            self.service_tier is not None or self.usage_asked or b'"usage"' in chunk
        )

    def _event(self, event: bytes) -> bytes:
        """One event (its `event:` line, if any, and its `data:` line), ended as events are."""
        lines = []
        for line in event.split(b"\n"):
            data = _json_data(line)
            if data is None:
                lines.append(line)
                continue
            reworded = self._chunk(data) if self.endpoint in USAGE_ON_ASKING else self._response_event(data)
            if reworded is None:
                return b""
            lines.append(_DATA + _encoded(reworded))
        return b"\n".join(lines) + b"\n\n"

    def _chunk(self, data: dict) -> dict | None:
        """A chat or completions chunk; None for the usage-only chunk of a client that did not ask for it."""
        if self.service_tier is not None:
            data["service_tier"] = self.service_tier
        if self.usage_asked:
            data.setdefault("usage", None)
            return data
        if data.get("choices") == [] and "usage" in data:
            return None
        data.pop("usage", None)
        return data

    def _response_event(self, data: dict) -> dict:
        response = data.get("response")
        if isinstance(response, dict) and self.service_tier is not None:
            response["service_tier"] = self.service_tier
        return data


def _json_data(line: bytes) -> dict | None:
    """The object a `data:` line carries, unless it is an error's (passed as it came), `[DONE]` or not JSON."""
    if not line.startswith(_DATA):
        return None
    try:
        data = json.loads(line[len(_DATA) :])
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and "error" not in data else None


def _encoded(data: dict) -> bytes:
    """As vLLM writes an event (compact, UTF-8); a lone surrogate echoed from the request goes out escaped."""
    try:
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(data, separators=(",", ":")).encode()
