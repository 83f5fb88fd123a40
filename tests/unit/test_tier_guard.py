"""The unit tier's guard (tests/unit/conftest.py) holds: a unit test that opens a socket, starts a process or opens a
database fails, naming what it reached."""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import sqlite3
import subprocess
import sys

import pytest

from tests.unit.conftest import ReachedOutside


def test_a_socket_is_refused():
    with socket.socket() as sock, pytest.raises(ReachedOutside, match="bind a socket"):
        sock.bind(("127.0.0.1", 0))
    with socket.socket() as sock, pytest.raises(ReachedOutside, match="connect a socket"):
        sock.connect(("127.0.0.1", 9))


def test_a_process_is_refused():
    with pytest.raises(ReachedOutside, match="start a process"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(ReachedOutside, match="start a process"):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_a_database_is_refused(tmp_path):
    with pytest.raises(ReachedOutside, match="open a database"):
        sqlite3.connect(tmp_path / "db.sqlite")
    with pytest.raises(ReachedOutside, match="open a database"):
        sqlite3.dbapi2.connect(":memory:")


def test_an_event_loop_still_runs():
    """Its self-pipe is a socketpair, made without bind or connect: async logic stays testable here."""
    assert asyncio.run(asyncio.sleep(0, result=7)) == 7
