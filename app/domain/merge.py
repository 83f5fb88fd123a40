"""`vbatch merge`: the result files of a batch and its retries (`app.domain.retry`) joined into one file that holds
every custom_id of the first batch's input once, in the input's order.

For each custom_id the line is the successful one from the latest batch that has one, else the error from the latest
batch that has one, copied byte for byte from its result file; a custom_id that no batch has a result for gets an
error line with code `no_result`. Two passes over the result files, so a large output is never held in memory: one
to choose (reading each line's head only), one to copy by offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from sqlalchemy.engine import Engine

from app.domain import files
from app.domain.errors import InvalidRequest, NotEnded, NotFound
from app.domain.lifecycle import TERMINAL
from app.domain.results import error_outcome, line_for, result_head
from app.domain.retry import check_ended, request_custom_id, retry_chain
from app.domain.validation import numbered_lines

NO_RESULT_MESSAGE = "No batch of the retry chain has a result for this request."
# How many custom_ids an error names before it only counts them.
NAMED = 5


class MergeRefused(ValueError):
    """The files given cannot be merged: they are not result lines, or not results of this input."""


@dataclass(frozen=True)
class Chosen:
    source: int  # which result file, in the order given
    offset: int
    length: int
    succeeded: bool


@dataclass
class MergeReport:
    lines: int = 0
    succeeded: int = 0
    failed: int = 0
    no_result: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ChainFiles:
    """The file ids `vbatch merge BATCH` reads: the first batch's input, then each batch's results, oldest first."""

    input_file_id: str
    result_file_ids: list[str]


def _choose(results: Sequence[Path]) -> dict[str, Chosen]:
    chosen: dict[str, Chosen] = {}
    for source, path in enumerate(results):
        with path.open("rb") as src:
            offset = 0
            for number, raw in enumerate(src, 1):
                line = raw.rstrip(b"\r\n")
                if line.strip():
                    try:
                        head = result_head(line)
                    except ValueError:
                        raise MergeRefused(f"{path} line {number} is not a batch result line.") from None
                    known = chosen.get(head.custom_id)
                    if head.succeeded or known is None or not known.succeeded:
                        chosen[head.custom_id] = Chosen(source, offset, len(line), head.succeeded)
                offset += len(raw)
    return chosen


def refuse_overwriting(output: Path, reads: Sequence[Path]) -> None:
    """The merged file is renamed over `output` at the end: a file merge reads from would be lost under it."""
    for path in reads:
        same = output.samefile(path) if output.exists() and path.exists() else output.resolve() == path.resolve()
        if same:
            raise MergeRefused(f"The output {output} is a file the merge reads ({path}): write it somewhere else.")


def merge(input_path: Path, results: Sequence[Path], out: BinaryIO) -> MergeReport:
    """Writes the merged lines to `out`, in `input_path`'s order; `results` are the result files of the batches,
    oldest batch first. MergeRefused if they hold results of custom_ids the input does not have, or if the input
    names a custom_id twice (a batch of it never ran: validation refuses that)."""
    chosen = _choose(results)
    foreign = set(chosen)
    first_line: dict[str, int] = {}
    report = MergeReport()
    with ExitStack() as stack:
        handles = [stack.enter_context(path.open("rb")) for path in results]
        for line in numbered_lines(input_path):
            custom_id = request_custom_id(line.data)
            if custom_id is None:
                continue
            if custom_id in first_line:
                raise MergeRefused(
                    f"Line {line.number} of the input repeats the custom_id {custom_id!r} of line "
                    f"{first_line[custom_id]}: no batch ran this input."
                )
            first_line[custom_id] = line.number
            foreign.discard(custom_id)
            report.lines += 1
            pick = chosen.pop(custom_id, None)
            if pick is None:
                report.no_result.append(custom_id)
                out.write(line_for(error_outcome(custom_id, "no_result", NO_RESULT_MESSAGE)))
                continue
            handles[pick.source].seek(pick.offset)
            out.write(handles[pick.source].read(pick.length) + b"\n")
            report.succeeded += pick.succeeded
            report.failed += not pick.succeeded
    if foreign:
        named = ", ".join(sorted(foreign)[:NAMED])
        raise MergeRefused(f"{len(foreign)} custom_ids of the results are not in the input ({named}): another job's.")
    return report


def chain_files(*, db: Engine, batch_id: str) -> ChainFiles:
    """The files to merge for `batch_id`'s retry chain, every batch of it ended and every file still there."""
    chain = retry_chain(db=db, batch_id=batch_id, owner=None)
    check_ended(chain[0])  # a batch that failed before it ran has no results to merge
    for row in chain:
        if row.status not in TERMINAL:
            raise NotEnded(row.id, row.status)
    wanted = [chain[0].input_file_id]
    wanted += [each for row in chain for each in (row.output_file_id, row.error_file_id) if each is not None]
    for file_id in wanted:
        try:
            files.get(db=db, file_id=file_id, owner=None)
        except NotFound:
            raise InvalidRequest(
                f"File {file_id} of the retry chain of {chain[0].id} is gone (deleted or expired); with copies of the "
                "files, merge them by path (--input).",
                code="file_not_found",
            ) from None
    return ChainFiles(wanted[0], wanted[1:])
