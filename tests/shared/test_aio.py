"""shared/aio.py's Cuttable: a task cut short on purpose reaches its awaiter as `Abandoned`,
while a cancellation of the awaiter itself stays a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from shared.aio import Abandoned, Cuttable, gather_first_error


@pytest.mark.timeout(10)
async def test_an_abandoned_task_reaches_its_awaiter_as_abandoned_with_the_reason() -> None:
    cuts = Cuttable()
    seen_cut: list[bool] = []

    async def work() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            seen_cut.append(cuts.cut(asyncio.current_task()))

    task = asyncio.ensure_future(work())
    waiting = asyncio.ensure_future(cuts.run("http://a", task))
    await asyncio.sleep(0)
    assert cuts.abandon("http://b", "not this one") == 0
    assert cuts.abandon("http://a", "no answer for 10 s") == 1
    with pytest.raises(Abandoned, match="no answer for 10 s"):
        await waiting
    assert seen_cut == [True]
    assert cuts.abandon("http://a", "again") == 0  # nothing left to cut


@pytest.mark.timeout(10)
async def test_cancelling_the_awaiter_is_a_cancellation_not_an_abandon() -> None:
    cuts = Cuttable()
    task = asyncio.ensure_future(asyncio.sleep(60))
    waiting = asyncio.ensure_future(cuts.run("http://a", task))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert task.cancelled()
    assert cuts.abandon("http://a", "late") == 0


@pytest.mark.timeout(10)
async def test_gather_first_error_lets_every_call_finish_then_raises_the_first_error() -> None:
    finished: list[str] = []

    async def fail() -> None:
        raise ValueError("the label failed")

    async def slow() -> str:
        await asyncio.sleep(0.05)
        finished.append("reset")
        return "reset"

    with pytest.raises(ValueError, match="the label failed"):
        await gather_first_error(fail(), slow())
    assert finished == ["reset"]
    assert await gather_first_error(slow()) == ["reset"]
