"""Named points where a fault-injection test makes vbatch die, to prove recovery from a crash at that moment.

`VBATCH_FAILPOINT=<name>` (tests only) turns one point on; unset, a point costs one environment lookup.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger("vbatch.failpoints")

# The whole service dies here, as a `kill -9` of its process group would do.
UPLOAD_SAVED = "upload_saved"  # an upload's bytes are on disk, its row is not
RESULTS_LINKED = "results_linked"  # a finishing batch's result files are linked, the batch row not yet final
# Every request whose body carries this `user` kills the engine core process (and only it) before it runs.
POISON = "poison"
POISON_USER = "vbatch-poison"


def armed(name: str) -> bool:
    return os.environ.get("VBATCH_FAILPOINT") == name


def crash_here(name: str) -> None:
    if not armed(name):
        return
    log.warning("failpoint %s: killing the service", name)
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def is_poison(body: dict) -> bool:
    return armed(POISON) and body.get("user") == POISON_USER
