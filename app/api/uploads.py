"""`POST /v1/files`: reads the multipart form as it arrives. The file part streams straight into Storage, so an
upload over its limit gets 413 as soon as it passes the limit, without being read whole or kept. Fields sent
before the file (the SDK and curl send `purpose` first) pick the limit; one sent after it is checked after."""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from python_multipart.exceptions import FormParserError, MultipartParseError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header
from sqlalchemy.engine import Engine

from app.api.errors import APIError, bad_request
from app.core.config import Settings
from app.core.ids import new_id
from app.core.storage import Storage, UploadTooLarge
from app.domain import files
from app.domain.files import check_purpose
from app.domain.models import FileRow

MIN_TTL, MAX_TTL = 3600, 2_592_000
# Room for the form's own bytes (boundaries, part headers, small fields) on top of the file's limit.
FORM_OVERHEAD = 64 * 1024
MAX_FIELD_BYTES = 4096
MAX_PARTS = 16
MAX_FILENAME_CHARS = 1024
_HEADERS_TOO_LONG = f"A form part's headers are too long (a filename may have at most {MAX_FILENAME_CHARS} characters)."
# A batch file's first line is read from this much of its head (a longer first line is left to validation).
SNIFF_BYTES = 1 << 20
EXPIRES_AFTER_FIELDS = ("expires_after[anchor]", "expires_after[seconds]")
FORM_FIELDS = ("file", "purpose", "expires_after", *EXPIRES_AFTER_FIELDS)


@dataclass
class Upload:
    """A file part already in Storage under `file_id` (not yet a file object), and the form around it."""

    file_id: str
    size: int
    filename: str
    purpose: str
    ttl_seconds: int | None
    model: str | None = None  # the model its first line names (a batch file's)


@dataclass
class _Stored:
    size: int
    filename: str
    head: bytes  # the first bytes, up to SNIFF_BYTES: enough to tell a JSONL file from anything else


@dataclass
class _Part:
    name: str
    filename: str | None


@dataclass
class _Events:
    """python-multipart calls back synchronously; these queue what it saw for the async reader."""

    queue: deque = field(default_factory=deque)
    headers: dict[bytes, bytes] = field(default_factory=dict)
    header_name: bytes = b""
    header_value: bytes = b""

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda data, start, end: self._add("header_name", data[start:end]),
            "on_header_value": lambda data, start, end: self._add("header_value", data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": lambda: self.queue.append(("part", self.headers)),
            "on_part_data": lambda data, start, end: self.queue.append(("data", bytes(data[start:end]))),
            "on_part_end": lambda: self.queue.append(("end", None)),
        }

    def _begin(self) -> None:
        self.headers = {}

    def _add(self, name: str, data: bytes) -> None:
        setattr(self, name, getattr(self, name) + data)

    def _header_end(self) -> None:
        self.headers[self.header_name.lower()] = self.header_value
        self.header_name = self.header_value = b""


class _FormStream:
    def __init__(self, request: Request, boundary: bytes) -> None:
        self.request = request
        self._body = request.stream()
        self._events = _Events()
        try:
            self._parser = MultipartParser(boundary, self._events.callbacks())  # type: ignore[arg-type]
        except FormParserError:  # a boundary longer than multipart allows (70) and the parser takes (256)
            raise bad_request("The multipart boundary is too long.", param="file") from None
        self._ended = False

    async def _next(self) -> tuple[str, object] | None:
        while not self._events.queue:
            if self._ended:
                return None
            try:
                chunk = await anext(self._body)
            except StopAsyncIteration:
                self._ended = True
                self._parser.finalize()
                if self._parser.state != MultipartState.END:
                    # A body cut short (a client or proxy that gave up): what arrived is not the file that was sent.
                    raise bad_request("The multipart body ended before its closing boundary.", param="file") from None
                continue
            try:
                self._parser.write(chunk)
            except MultipartParseError as exc:
                if "header size" in str(exc):  # python-multipart's limit on a part's headers
                    raise bad_request(_HEADERS_TOO_LONG, param="file") from None
                raise bad_request("The multipart body could not be parsed.", param="file") from None
        return self._events.queue.popleft()

    async def parts(self) -> AsyncIterator[_Part]:
        """Each part in turn; a part's data left unread by the caller is skipped."""
        count = 0
        while (event := await self._next()) is not None:
            kind, value = event
            if kind != "part":
                continue
            count += 1
            if count > MAX_PARTS:
                raise bad_request(f"The form has more than {MAX_PARTS} parts.", param="file")
            assert isinstance(value, dict)
            _, options = parse_options_header(value.get(b"content-disposition", b""))
            filename = options.get(b"filename")
            yield _Part(
                name=options.get(b"name", b"").decode("utf-8", "replace"),
                filename=None if filename is None else filename.decode("utf-8", "replace"),
            )

    async def data(self) -> AsyncIterator[bytes]:
        """The current part's bytes, up to its end."""
        while (event := await self._next()) is not None:
            kind, value = event
            if kind == "end":
                return
            if kind == "data":
                assert isinstance(value, bytes)
                yield value

    async def text(self, name: str) -> str:
        value = b""
        async for chunk in self.data():
            value += chunk
            if len(value) > MAX_FIELD_BYTES:
                raise bad_request(f"The form field '{name}' is too long.", param=name)
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise bad_request(f"The form field '{name}' is not valid UTF-8.", param=name) from None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"File is too large. The limit is {limit} bytes.", param="file", code="file_too_large")


def _boundary(request: Request) -> bytes:
    content_type, options = parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get(b"boundary")
    if content_type != b"multipart/form-data" or not boundary:
        raise bad_request("Uploads must be multipart/form-data with fields 'file' and 'purpose'.", param="file")
    return boundary


def _declared_length(request: Request) -> int | None:
    try:
        return int(request.headers["content-length"])
    except (KeyError, ValueError):
        return None


def _limit(settings: Settings, purpose: str | None) -> int:
    if purpose is None:
        return max(settings.max_upload_bytes, settings.max_batch_upload_bytes)
    return settings.upload_limit(purpose)


def _check_declared(request: Request, limit: int) -> None:
    declared = _declared_length(request)
    if declared is not None and declared > limit + FORM_OVERHEAD:
        raise _too_large(limit)


async def store_upload(request: Request, *, storage: Storage, settings: Settings, db: Engine, owner: str) -> FileRow:
    """The multipart form's file stored and recorded as `owner`'s file object (the API's and the console's
    upload)."""
    upload = await receive_upload(request, storage=storage, settings=settings)
    return await asyncio.to_thread(
        files.record_upload,
        db=db,
        file_id=upload.file_id,
        size=upload.size,
        filename=upload.filename,
        purpose=upload.purpose,
        ttl_seconds=upload.ttl_seconds,
        owner=owner,
        model=upload.model,
    )


async def receive_upload(request: Request, *, storage: Storage, settings: Settings) -> Upload:
    """Stores the file part and returns it with the form's fields; on any error nothing stays in Storage."""
    form = _FormStream(request, _boundary(request))
    _check_declared(request, _limit(settings, None))
    fields: dict[str, str] = {}
    file_id = new_id("file-")
    stored: _Stored | None = None
    try:
        async for part in form.parts():
            if part.name in fields or (part.name == "file" and stored is not None):
                # Which of two values was meant cannot be told: the last would win unseen.
                raise bad_request(f"The form sends '{part.name}' twice: send it once.", param=part.name)
            if part.name == "file" and part.filename is not None:
                stored = await _store(form, part, fields, file_id, storage=storage, settings=settings)
            elif part.name in FORM_FIELDS and part.name != "file":
                fields[part.name] = await form.text(part.name)
                if part.name == "purpose":
                    check_purpose(fields["purpose"])
            else:
                raise bad_request(
                    f"Unrecognized request argument supplied: '{part.name}'.", param=part.name, code="unknown_parameter"
                )
        return _complete(fields, stored, file_id, settings)
    except BaseException:
        if stored is not None:
            await storage.delete(file_id)
        raise


async def _store(
    form: _FormStream, part: _Part, fields: dict[str, str], file_id: str, *, storage: Storage, settings: Settings
) -> _Stored:
    limit = _limit(settings, fields.get("purpose"))
    _check_declared(form.request, limit)
    filename = part.filename or "upload"
    if len(filename) > MAX_FILENAME_CHARS:
        raise bad_request(f"The filename is longer than {MAX_FILENAME_CHARS} characters.", param="file")
    head = bytearray()

    async def keeping_head() -> AsyncIterator[bytes]:
        async for chunk in form.data():
            if len(head) < SNIFF_BYTES:
                head.extend(chunk[: SNIFF_BYTES - len(head)])
            yield chunk

    try:
        size = await storage.save_stream(file_id, keeping_head(), max_bytes=limit, keep_free=True)
    except UploadTooLarge:
        raise _too_large(limit) from None
    return _Stored(size=size, filename=filename, head=bytes(head))


def _complete(fields: dict[str, str], stored: _Stored | None, file_id: str, settings: Settings) -> Upload:
    if stored is None:
        raise bad_request("Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
    purpose = fields.get("purpose")
    if purpose is None:
        raise bad_request("Missing required parameter: 'purpose'.", param="purpose", code="missing_required_parameter")
    if stored.size > settings.upload_limit(purpose):  # `purpose` came after the file
        raise _too_large(settings.upload_limit(purpose))
    # A batch file of blank lines (after a byte order mark, which is accepted) holds no request: as empty as one of
    # no bytes.
    text = stored.head.removeprefix(b"\xef\xbb\xbf")
    blank = stored.size == 0 or (purpose == "batch" and stored.size == len(stored.head) and not text.strip())
    if blank:
        raise bad_request("The file is empty.", param="file", code="empty_file")
    head = _read_head(stored.head) if purpose == "batch" else _Head(jsonl=True)
    if not head.jsonl:
        raise bad_request(
            "Invalid file format for Batch API. Must be .jsonl: one JSON object (a request) a line.",
            param="file",
            code="invalid_file_format",
        )
    ttl = _ttl(fields, purpose, settings)
    return Upload(
        file_id=file_id,
        size=stored.size,
        filename=stored.filename,
        purpose=purpose,
        ttl_seconds=ttl,
        model=head.model,
    )


@dataclass(frozen=True)
class _Head:
    jsonl: bool  # whether the file opens like JSONL (`_read_head`)
    model: str | None = None  # the model its first line names, if it names one


def _read_head(head: bytes) -> _Head:
    """Whether the file's first line is a JSON object, and the model it names. Every line is checked when a batch
    validates it; this only turns away, at once, the CSV, text or binary file uploaded by mistake, and tells the
    batch made from the file which workers may claim it (those that serve the model)."""
    first, newline, _ = head.removeprefix(b"\xef\xbb\xbf").lstrip().partition(b"\n")
    if not newline and len(head) >= SNIFF_BYTES:
        return _Head(jsonl=True)  # a first line longer than we read: validation will judge it
    try:
        request = json.loads(first)
    except RecursionError:
        return _Head(jsonl=True)  # nested deeper than Python parses: validation reports it with its line
    except ValueError:
        return _Head(jsonl=False)
    if not isinstance(request, dict):
        return _Head(jsonl=False)
    body = request.get("body")
    model = body.get("model") if isinstance(body, dict) else None
    return _Head(jsonl=True, model=model if isinstance(model, str) and _storable(model) else None)


def _storable(text: str) -> bool:
    """A lone surrogate (a `\\udc00` escape) has no UTF-8 form to store; validation reports the line."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _expires_after(fields: dict[str, str]) -> tuple[str | None, str | None]:
    """(anchor, seconds) from `expires_after[anchor]`/`[seconds]`, or from `expires_after` sent as a JSON object."""
    if "expires_after" not in fields:
        return fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    try:
        value = json.loads(fields["expires_after"])
    except ValueError:
        value = None
    if not isinstance(value, dict) or set(value) - {"anchor", "seconds"}:
        raise bad_request(
            "'expires_after' must be an object with 'anchor' and 'seconds'.",
            param="expires_after",
            code="invalid_value",
        )
    anchor, seconds = value.get("anchor"), value.get("seconds")
    return (None if anchor is None else str(anchor)), (None if seconds is None else str(seconds))


def _ttl(fields: dict[str, str], purpose: str, settings: Settings) -> int | None:
    anchor, seconds = _expires_after(fields)
    if anchor is None and seconds is None:
        return settings.batch_file_ttl_seconds if purpose == "batch" else None
    # `created_at` is the only anchor there is, so a form that gives only the seconds means it.
    if anchor not in (None, "created_at"):
        raise bad_request(
            "'expires_after[anchor]' must be 'created_at'.", param="expires_after.anchor", code="invalid_value"
        )
    try:
        value = int(str(seconds))
    except ValueError:
        value = -1
    if not MIN_TTL <= value <= MAX_TTL:
        raise bad_request(
            f"'expires_after[seconds]' must be an integer from {MIN_TTL} to {MAX_TTL}.",
            param="expires_after.seconds",
            code="invalid_value",
        )
    return value
