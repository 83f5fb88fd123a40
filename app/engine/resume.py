"""Picking a batch up again after a restart: what its part files already hold is done and is not run again."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from app.batches import Progress
from app.results import add_usage
from app.validation import request_lines


@dataclass
class Finished:
    lines: set[int] = field(default_factory=set)
    progress: Progress = field(default_factory=Progress)
    output_lines: int = 0
    error_lines: int = 0


def cut_torn_tail(path: Path) -> None:
    """A crash mid-write can leave half a line at the end: cut the file back to its last newline."""
    if not path.exists():
        return
    with path.open("rb+") as part:
        size = part.seek(0, os.SEEK_END)
        keep = size
        while keep > 0:
            step = min(65536, keep)
            part.seek(keep - step)
            chunk = part.read(step)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = keep - step + newline + 1
                break
            keep -= step
        if keep != size:
            part.truncate(keep)
            part.flush()
            os.fsync(part.fileno())


def _records(path: Path):
    if not path.exists():
        return
    with path.open("rb") as part:
        for line in part:
            yield json.loads(line)


def finished_lines(input_path: Path, output_part: Path, error_part: Path) -> Finished:
    """Line numbers (and counts, usage) of the requests whose results the part files already hold."""
    finished = Finished()
    if not output_part.exists() and not error_part.exists():
        return finished
    for path in (output_part, error_part):
        cut_torn_tail(path)
    number_of = {request["custom_id"]: number for number, request in request_lines(input_path)}
    for record in _records(output_part):
        finished.lines.add(number_of[record["custom_id"]])
        finished.output_lines += 1
        finished.progress.completed += 1
        add_usage(finished.progress, (record.get("response") or {}).get("body"))
    for record in _records(error_part):
        finished.lines.add(number_of[record["custom_id"]])
        finished.error_lines += 1
        finished.progress.failed += 1
        add_usage(finished.progress, (record.get("response") or {}).get("body"))
    return finished
