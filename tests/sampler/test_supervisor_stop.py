"""Supervisor.stop waits a bounded time for a cancelled task: one that will not stop (it swallows
the cancellation, as a task stuck in cleanup does) is logged with its stack and left behind,
so the sampler's shutdown keeps to its budget."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from services.sampler.storage.supervisor import Supervisor


async def test_a_task_that_stops_when_cancelled_is_waited_for():
    supervisor = Supervisor()
    stopped = asyncio.Event()

    async def obedient() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            stopped.set()

    supervisor.spawn("obedient", obedient)
    await asyncio.sleep(0.01)
    await supervisor.stop("obedient", deadline=5.0)
    assert stopped.is_set() and supervisor.tasks["obedient"].done()


async def test_a_task_that_will_not_stop_is_left_behind_after_the_deadline(caplog: pytest.LogCaptureFixture):
    supervisor = Supervisor()
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                continue  # what a task stuck in its cleanup amounts to

    supervisor.spawn("stubborn", stubborn)
    try:
        await asyncio.sleep(0.01)
        started = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="tandem.supervisor"):
            await supervisor.stop("stubborn", deadline=0.3)
        assert 0.25 <= time.monotonic() - started < 2.0
        assert not supervisor.tasks["stubborn"].done()
        message = " ".join(r.getMessage() for r in caplog.records)
        assert "background task stubborn did not stop within 0.3s of being cancelled" in message, message
        assert "Stack for <Task cancelling name='stubborn'" in message, message
    finally:
        release.set()  # let it end, or the test's event loop could never close
        supervisor.tasks["stubborn"].cancel()
        await asyncio.wait([supervisor.tasks["stubborn"]], timeout=2)
