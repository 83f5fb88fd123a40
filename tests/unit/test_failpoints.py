"""The hold failpoint that e2e tests use to catch a batch mid-run, whatever the engine's speed."""

from __future__ import annotations

import asyncio

import pytest

from app.core import failpoints
from app.core.failpoints import Failpoints


async def numbers(count: int):
    for number in range(count):
        yield number


def test_unarmed_hold_is_not_installed_even_with_the_file(tmp_path):
    (tmp_path / failpoints.HOLD_FILE).touch()
    items = numbers(5)
    assert Failpoints("poison").held(items, tmp_path) is items


def test_armed_hold_stops_after_its_count_until_the_file_goes(tmp_path):
    points = Failpoints("poison,hold_after:2")
    hold = tmp_path / failpoints.HOLD_FILE
    hold.touch()

    async def scenario():
        items = points.held(numbers(4), tmp_path)
        first = [await anext(items), await anext(items)]
        third = asyncio.ensure_future(anext(items))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(third), timeout=0.3)
        hold.unlink()
        return [*first, await third, await anext(items)]

    assert asyncio.run(scenario()) == [0, 1, 2, 3]
    assert points.armed("poison") and not points.armed("hold") and not Failpoints("").points
