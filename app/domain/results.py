"""Output and error file lines (OpenAI's BatchRequestOutput), and the per-batch token usage they add up to."""

from __future__ import annotations

import json
from dataclasses import dataclass

from app.core.ids import new_id
from app.domain.batches import Progress

EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
CANCELLED_MESSAGE = "The batch was cancelled before this request executed."


@dataclass(frozen=True)
class EncodedBody:
    """A response body already in the form the output file holds it (compact JSON), with its usage read out. Bodies
    are encoded where they are made, in a front-end process when there are several, so the loop only copies bytes:
    an embedding's thousands of floats are never parsed or printed again."""

    json: bytes
    usage: dict
    cut: bool = False  # stopped at its output cap (`stopped_at_cap`)


def encode_body(body: dict) -> EncodedBody:
    return EncodedBody(_compact(body), body.get("usage") or {}, stopped_at_cap(body))


def stopped_at_cap(body: object) -> bool:
    """Whether an answer stopped at its output cap, not on its own: a choice finished by `length` (the line's
    max_tokens, or the end of the context), or a Responses answer left incomplete at `max_output_tokens`."""
    if not isinstance(body, dict):
        return False
    choices = body.get("choices")
    if isinstance(choices, list):
        return any(isinstance(choice, dict) and choice.get("finish_reason") == "length" for choice in choices)
    details = body.get("incomplete_details")
    return isinstance(details, dict) and details.get("reason") == "max_output_tokens"


def rendered_body(data: bytes) -> EncodedBody:
    """A body the handler answered as JSON text (vLLM's pooling handlers render their own response): kept byte for
    byte, as `vllm serve` sends it, so an embedding's floats are not parsed and printed again. Its usage is read
    from the end, where vLLM puts it, or else from the whole; text that is not one line is encoded anew."""
    if b"\n" not in data and b"\r" not in data:
        at = data.rfind(b'"usage":')
        try:
            usage = json.loads(data[at + len(b'"usage":') : -1]) if at != -1 else None
        except ValueError:
            usage = None
        if isinstance(usage, dict):
            return EncodedBody(data, usage)
    body = json.loads(data)
    return EncodedBody(_compact(body), (body.get("usage") if isinstance(body, dict) else None) or {})


# What an executor answers: a body as the serving layer made it, or one a front-end process encoded.
Body = dict | EncodedBody


@dataclass(frozen=True)
class Outcome:
    """What one request came to: an HTTP status and body from the handler, or a non-HTTP error."""

    custom_id: str
    status_code: int | None
    body: EncodedBody | None
    error_code: str | None = None
    error_message: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300

    @property
    def usage(self) -> dict:
        return self.body.usage if self.body is not None else {}

    @property
    def cut(self) -> bool:
        return self.body is not None and self.body.cut


def part_names(batch_id: str, token: int) -> tuple[str, str]:
    """A running batch's result files in Storage, output and error lines as they finish: each lease token
    (`app.domain.leases`) writes its own, so a run that lost its lease cannot write into its successor's files
    (token 0: the names from before leases)."""
    run = batch_id if token == 0 else f"{batch_id}.{token}"
    return f"{run}.output.part", f"{run}.error.part"


def index_name(batch_id: str) -> str:
    """A batch's input index in Storage (`app.domain.input_index`), from validation until the batch ends."""
    return f"{batch_id}.index"


def input_name(batch_id: str) -> str:
    """A batch's own name for its input's bytes, from validation until it ends: deleting the input's file object
    (which clients may do at any time) leaves the batch its input."""
    return f"{batch_id}.input"


def run_files(batch_id: str, last_token: int) -> tuple[str, ...]:
    """What an active batch keeps in Storage: its index, its input, and the part files of every lease token up to
    `last_token` (a run that died before its first checkpoint leaves its own too)."""
    parts = [name for token in range(last_token + 1) for name in part_names(batch_id, token)]
    return (*parts, index_name(batch_id), input_name(batch_id))


def run_file_batch(name: str) -> str | None:
    """The batch whose run file `name` is, under any token (the sweep keeps them while it is active), or None."""
    batch_id, dot, _ = name.partition(".")
    return batch_id if dot and batch_id.startswith("batch_") else None


def http_outcome(custom_id: str, status_code: int, body: Body) -> Outcome:
    encoded = body if isinstance(body, EncodedBody) else encode_body(body)
    return Outcome(custom_id=custom_id, status_code=status_code, body=encoded)


def error_outcome(custom_id: str, code: str, message: str) -> Outcome:
    return Outcome(custom_id=custom_id, status_code=None, body=None, error_code=code, error_message=message)


def line_for(outcome: Outcome) -> bytes:
    """The output or error file's line: the bytes `json.dumps` of the whole record would give, with the body copied in
    as it was encoded."""
    if outcome.body is None:
        error = {"code": outcome.error_code, "message": outcome.error_message}
        record = {"id": new_id("batch_req_"), "custom_id": outcome.custom_id, "response": None, "error": error}
        return _compact(record) + b"\n"
    head = {"id": new_id("batch_req_"), "custom_id": outcome.custom_id}
    response = {"status_code": outcome.status_code, "request_id": new_id("req_")}
    return b"".join(
        (
            _compact(head)[:-1],
            b',"response":',
            _compact(response)[:-1],
            b',"body":',
            outcome.body.json,
            b'},"error":null}\n',
        )
    )


_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ResultHead:
    """What a result line says before its body: whose it is and, if the handler answered, with what status."""

    custom_id: str
    status_code: int | None

    @property
    def succeeded(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def result_head(line: bytes) -> ResultHead:
    """The head of an output or error file's line. Lines `line_for` wrote are read up to the status code only: an
    embedding's body of thousands of floats is not parsed; a line laid out otherwise is parsed whole (ValueError if
    it is not a result line)."""
    text = line.decode()
    try:
        return _head_as_written(text)
    except (ValueError, LookupError, RecursionError):
        try:
            record = json.loads(text)
        except RecursionError:  # nested past the parser's stack: no line `line_for` writes is
            raise ValueError("not a batch result line") from None
        response = record.get("response") if isinstance(record, dict) else None
        status = response.get("status_code") if isinstance(response, dict) else None
        custom_id = record.get("custom_id") if isinstance(record, dict) else None
        if not isinstance(custom_id, str) or not isinstance(status, int | None):
            raise ValueError("not a batch result line") from None
        return ResultHead(custom_id, status)


def _head_as_written(text: str) -> ResultHead:
    """`{"id":...,"custom_id":...,"response":null` or `...,"response":{"status_code":N`, as `line_for` writes."""
    if not text.startswith('{"id":'):
        raise ValueError("another layout")
    _, at = _DECODER.raw_decode(text, len('{"id":'))
    if not text.startswith(',"custom_id":', at):
        raise ValueError("another layout")
    custom_id, at = _DECODER.raw_decode(text, at + len(',"custom_id":'))
    if text.startswith(',"response":null', at):
        status = None
    elif text.startswith(',"response":{"status_code":', at):
        status, _ = _DECODER.raw_decode(text, at + len(',"response":{"status_code":'))
    else:
        raise ValueError("another layout")
    if not isinstance(custom_id, str) or not isinstance(status, int | None) or isinstance(status, bool):
        raise ValueError("another layout")
    return ResultHead(custom_id, status)


def _compact(value: object) -> bytes:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:
        # A lone surrogate (validation refuses them, but a result may come from elsewhere) has no UTF-8 form; as a
        # \u escape it is the same JSON value, and a writer that raised here would leave its batch never ending.
        return json.dumps(value, ensure_ascii=True, separators=(",", ":")).encode()


def add_usage(progress: Progress, usage: dict, *, cut: bool = False) -> None:
    """One line's usage, its answer `cut` at its cap or not. Chat and completions report prompt/completion tokens;
    responses input/output; embeddings, score and rerank prompt only."""
    prompt = usage.get("prompt_tokens", usage.get("input_tokens")) or 0
    completion = usage.get("completion_tokens", usage.get("output_tokens")) or 0
    prompt_details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
    progress.input_tokens += prompt
    progress.output_tokens += completion
    progress.cached_tokens += prompt_details.get("cached_tokens") or 0
    progress.reasoning_tokens += completion_details.get("reasoning_tokens") or 0
    if cut:
        shortest = progress.shortest_cut_output if progress.cut_lines else completion
        progress.cut_lines += 1
        progress.cut_output_tokens += completion
        progress.shortest_cut_output = min(shortest, completion)
    else:
        progress.longest_uncut_output = max(progress.longest_uncut_output, completion)
