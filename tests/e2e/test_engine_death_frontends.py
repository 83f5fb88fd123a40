"""An engine death behind two front-end processes (`--api-server-count 2`), on the machinery of
tests/e2e/test_engine_death.py (a module of its own, so that its long test and that module's can run on two
workers). What must hold is what tests/e2e/test_crash_recovery.py's docstring says."""

from __future__ import annotations

from collections import Counter

from tests.e2e.test_crash_recovery import create, request_lines, results, wait_done
from tests.e2e.test_engine_death import kill_the_engine_core_mid_run
from tests.helpers import holding


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
