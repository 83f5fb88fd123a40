"""The unit tier: logic alone. No server, no engine, no subprocess, no socket, no database: each test runs with those
refused (`refuse_the_outside`), so a test that reaches one fails here, naming it, and belongs in tests/integration.
This conftest (and the root one) imports nothing of the app: the tier starts in a second."""

from __future__ import annotations

import multiprocessing.process
import socket
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from typing import NoReturn

import pytest


class ReachedOutside(AssertionError):
    """A unit test reached a socket, a process or a database."""


def _refused(what: str) -> Callable[..., NoReturn]:
    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise ReachedOutside(f"a unit test may not {what} (move it to tests/integration)")

    return refuse


@pytest.fixture(autouse=True)
def refuse_the_outside(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Sockets: connect and bind (an event loop's own socketpair, made without either, still works).
    monkeypatch.setattr(socket.socket, "connect", _refused("connect a socket"))
    monkeypatch.setattr(socket.socket, "connect_ex", _refused("connect a socket"))
    monkeypatch.setattr(socket.socket, "bind", _refused("bind a socket"))
    # Processes: subprocess.run, check_output, Popen (asyncio's subprocesses go through Popen too).
    monkeypatch.setattr(subprocess.Popen, "__init__", _refused("start a process"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refused("start a process"))
    # SQLite: SQLAlchemy's pysqlite dialect calls sqlite3.dbapi2.connect; Postgres is reached only over a socket
    # after its server's process starts.
    monkeypatch.setattr(sqlite3, "connect", _refused("open a database"))
    monkeypatch.setattr(sqlite3.dbapi2, "connect", _refused("open a database"))
    yield
