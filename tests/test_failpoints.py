"""The hold failpoint that e2e tests use to catch a batch mid-run, whatever the engine's speed."""

from __future__ import annotations

import asyncio

import pytest

from app import failpoints


async def numbers(count: int):
    for number in range(count):
        yield number


def test_unarmed_hold_passes_everything_even_with_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("VBATCH_FAILPOINT", "poison")
    (tmp_path / failpoints.HOLD_FILE).touch()

    async def collect():
        return [n async for n in failpoints.held(numbers(5), tmp_path)]

    assert asyncio.run(collect()) == [0, 1, 2, 3, 4]


def test_armed_hold_stops_after_its_count_until_the_file_goes(tmp_path, monkeypatch):
    monkeypatch.setenv("VBATCH_FAILPOINT", "poison,hold_after:2")
    hold = tmp_path / failpoints.HOLD_FILE
    hold.touch()

    async def scenario():
        items = failpoints.held(numbers(4), tmp_path)
        first = [await anext(items), await anext(items)]
        third = asyncio.ensure_future(anext(items))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(third), timeout=0.3)
        hold.unlink()
        return [*first, await third, await anext(items)]

    assert asyncio.run(scenario()) == [0, 1, 2, 3]
    assert failpoints.armed("poison") and not failpoints.armed("hold")
