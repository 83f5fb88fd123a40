"""An engine death behind two front-end processes (`--api-server-count 2`), on the machinery of
tests/e2e/test_crash_recovery.py (a module of its own, so that its long test and that module's can run on two
workers). What must hold is what tests/e2e/test_crash_recovery.py's docstring says."""

from __future__ import annotations

import os
import signal
from collections import Counter

from openai import OpenAI

from tests.e2e.test_crash_recovery import Lineage, check_exactly_once, create, request_lines, results, wait_done
from tests.helpers import holding


def kill_the_engine_core_mid_run(lineage: Lineage, client: OpenAI) -> None:
    """`kill -9` of the engine core while a 16-line batch runs (the server holds at 4 lines sent): the service
    starts a new one and the batch completes, each line once, those seen before the kill as first written."""
    assert lineage.server is not None
    with holding(lineage.data_dir):
        killed = create(client, request_lines(16))
        seen = lineage.wait_partial(killed, at_least=2)
        [core] = lineage.server.engine_core_pids()
        os.kill(core, signal.SIGKILL)
    batch = wait_done(client, killed)
    assert batch.status == "completed"
    check_exactly_once(client, batch, 16, seen)
    assert lineage.server.engine_core_pids() != [core]


def test_behind_two_front_end_processes_an_engine_death_and_a_cancel(lineage):
    """The same engine behind two front-end processes (`--api-server-count 2`): an engine core killed mid-run is
    restarted with its front ends and the batch completes, each line once; a cancel ends the next batch."""
    lineage.flags += ["--api-server-count", "2"]
    server = lineage.start(failpoint="hold_after:4")
    client = lineage.client()
    assert len(server.frontend_pids()) == 2
    kill_the_engine_core_mid_run(lineage, client)
    assert len(server.frontend_pids()) == 2

    with holding(lineage.data_dir):
        cancelled = create(client, request_lines(16))
        lineage.wait_partial(cancelled, at_least=2)
        client.batches.cancel(cancelled)
        batch = wait_done(client, cancelled)
    assert batch.status == "cancelled"
    finished = results(client, batch.output_file_id)
    unfinished = results(client, batch.error_file_id)
    assert Counter(r["custom_id"] for r in finished + unfinished) == Counter(f"req-{i}" for i in range(16))
    assert 2 <= len(finished) < 16
