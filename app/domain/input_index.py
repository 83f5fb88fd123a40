"""The index of a batch's input file, built by validation in its one pass over the file.

For every request line: its 1-based line number, byte offset and length, custom_id, the digest of its long
leading text (lines that share one are fed together, `app.engine.batch.ordering`), and the LoRA adapter it names, if any
(an adapter's lines are fed together too), as a number into the names the file uses. Everything after validation
works from it: planning reads only digests and adapters, resume and cancel/expiry only custom_ids, and the feed and
the re-runs after an engine death read each line they need by its offset. The file itself is never scanned again.

It is kept beside the batch's results (`<batch>.index`, in Storage), so a restart resumes without scanning the
input either.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

# Lines that agree on this many leading characters (about 500 tokens) are taken to share a prefix worth caching.
PREFIX_CHARS = 2048
_NO_DIGEST = b""
_BASE = ""


def leading_text(body: dict) -> str:
    if isinstance(body.get("messages"), list):
        return "".join(
            str(m["content"]) if isinstance(m.get("content"), str) else json.dumps(m.get("content"))
            for m in body["messages"]
            if isinstance(m, dict)
        )
    for name in ("prompt", "input"):
        value = body.get(name)
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and isinstance(value[0], int):
            return ",".join(map(str, value[: PREFIX_CHARS // 4]))
    return ""


def prefix_digest(body: dict) -> bytes | None:
    text = leading_text(body)
    if len(text) < PREFIX_CHARS:
        return None
    return hashlib.blake2b(text[:PREFIX_CHARS].encode(), digest_size=16).digest()


@dataclass
class InputIndex:
    numbers: array = field(default_factory=lambda: array("q"))
    offsets: array = field(default_factory=lambda: array("q"))
    lengths: array = field(default_factory=lambda: array("q"))
    custom_ids: list[str] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)  # b"" where the line has no long leading text
    # Each line's adapter as a number into `adapter_names`, whose first name, "", stands for the base model.
    adapter_numbers: array = field(default_factory=lambda: array("l"))
    adapter_names: list[str] = field(default_factory=lambda: [_BASE])

    def __post_init__(self) -> None:
        self._adapter_number = {name: number for number, name in enumerate(self.adapter_names)}

    def __len__(self) -> int:
        return len(self.numbers)

    def add(
        self, *, number: int, offset: int, length: int, custom_id: str, body: dict, adapter: str | None = None
    ) -> None:
        """`adapter`: the LoRA adapter the line names (None: the base model)."""
        self.numbers.append(number)
        self.offsets.append(offset)
        self.lengths.append(length)
        self.custom_ids.append(custom_id)
        self.digests.append(prefix_digest(body) or _NO_DIGEST)
        self.adapter_numbers.append(self._number_of(adapter or _BASE))

    def add_from(self, other: InputIndex, position: int, *, offset: int) -> None:
        """The line at `position` of `other`, at `offset` in this index's file (a shard's:
        `app.engine.batch.shards`)."""
        self.numbers.append(other.numbers[position])
        self.offsets.append(offset)
        self.lengths.append(other.lengths[position])
        self.custom_ids.append(other.custom_ids[position])
        self.digests.append(other.digests[position])
        self.adapter_numbers.append(self._number_of(other.adapter_names[other.adapter_numbers[position]]))

    def _number_of(self, adapter: str) -> int:
        number = self._adapter_number.get(adapter)
        if number is None:
            number = self._adapter_number[adapter] = len(self.adapter_names)
            self.adapter_names.append(adapter)
        return number

    def digest(self, position: int) -> bytes | None:
        return self.digests[position] or None

    @property
    def adapter_count(self) -> int:
        """The distinct LoRA adapters the lines name."""
        return len(self.adapter_names) - 1

    def position_of(self) -> dict[str, int]:
        """custom_id -> position in the index (custom_ids are unique in a valid file)."""
        return {custom_id: position for position, custom_id in enumerate(self.custom_ids)}

    def read(self, src: BinaryIO, position: int) -> dict:
        """The request at `position`, read by its offset from the open input file."""
        src.seek(self.offsets[position])
        return json.loads(src.read(self.lengths[position]))

    def requests(self, path: Path, positions: Iterable[int]) -> Iterator[tuple[int, dict]]:
        """(position, request) for each position, in the order given."""
        with path.open("rb") as src:
            for position in positions:
                yield position, self.read(src, position)

    def to_bytes(self) -> bytes:
        record = {
            "numbers": self.numbers.tolist(),
            "offsets": self.offsets.tolist(),
            "lengths": self.lengths.tolist(),
            "custom_ids": self.custom_ids,
            "digests": [d.hex() for d in self.digests],
        }
        if self.adapter_count:
            record["adapter_names"] = self.adapter_names
            record["adapter_numbers"] = self.adapter_numbers.tolist()
        return json.dumps(record, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> InputIndex:
        record = json.loads(data)
        numbers = array("q", record["numbers"])
        # Written without adapters: by a file on the base model alone, or by a vbatch that kept none (all base).
        adapter_numbers = array("l", record.get("adapter_numbers") or bytes(len(numbers) * array("l").itemsize))
        return cls(
            numbers=numbers,
            offsets=array("q", record["offsets"]),
            lengths=array("q", record["lengths"]),
            custom_ids=record["custom_ids"],
            digests=[bytes.fromhex(d) for d in record["digests"]],
            adapter_numbers=adapter_numbers,
            adapter_names=record.get("adapter_names") or [_BASE],
        )
