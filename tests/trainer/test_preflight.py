"""Bad input at start-up, in one line (issue 25): a `--model` that is no model, an API token the
sampler refuses (checked before the model loads), and waits on the sampler that say what they
wait for, every `wait_log_interval`, up to `retry_for` (services/trainer/preflight.py,
shared/waiting.py). Real sampler servers on free ports; the real CLI."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.trainer.entrypoint import main as trainer_main
from shared.client import SamplerClient, SamplerUnavailable, Unauthorized
from tests.support.servers import REPO, refused_port

TOKEN = "preflight-token"


@pytest.fixture
def refused_url() -> Iterator[str]:
    """A URL nothing answers at for the whole test (tests/support/servers.refused_port)."""
    with refused_port() as port:
        yield f"http://127.0.0.1:{port}"


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "services.cli", "trainer", *args]
    return subprocess.run(argv, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


def test_a_model_that_is_not_there_is_refused_in_one_line(tmp_path: Path, refused_url: str) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"\0")
    for model, needles in (("/missing", ["--model /missing does not exist", "Hugging Face cache"]),
                           (str(empty), [f"--model {empty} is not a Hugging Face model directory", "config.json"]),
                           (str(a_file), [f"--model {a_file} is a file"])):
        t0 = time.monotonic()
        done = _cli("--model", model, "--sampler-url", refused_url)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr  # no traceback, no log line: the sampler was not asked
        for needle in (*needles, "tandem init-model"):
            assert needle in lines[0], (needle, lines[0])
        assert "Traceback" not in done.stderr and "Repo id" not in done.stderr
        assert time.monotonic() - t0 < 20


def test_a_model_in_the_local_hub_cache_is_accepted(tiny_model_dir: Path, tmp_path: Path, refused_url: str) -> None:
    """What `from_pretrained` loads offline today stays allowed: a hub name whose files are cached."""
    snapshot = tmp_path / "hub" / "models--local--tiny" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for entry in tiny_model_dir.iterdir():
        (snapshot / entry.name).write_bytes(entry.read_bytes())
    (tmp_path / "hub" / "models--local--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--local--tiny" / "refs" / "main").write_text("abc")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    # Past the model check, the trainer looks for the sampler (none here): exit 4, not 2.
    done = _cli("--model", "local/tiny", "--sampler-url", refused_url, "--retry-for", "0.5", env=env)
    assert done.returncode == 4, done.stderr
    assert "does not exist" not in done.stderr
    missing = _cli("--model", "local/absent", "--sampler-url", refused_url, env=env)
    assert missing.returncode == 2 and "--model local/absent does not exist" in missing.stderr, missing.stderr


async def test_get_auth_answers_for_the_token(make_sampler) -> None:
    locked = make_sampler(api_token=TOKEN)
    async with httpx.AsyncClient(base_url=locked.url, timeout=10) as http:
        assert (await http.get("/auth", headers={"Authorization": f"Bearer {TOKEN}"})).status_code == 204
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            refused = await http.get("/auth", headers=headers)
            assert refused.status_code == 401, (headers, refused.text)
            assert refused.headers["www-authenticate"].lower().startswith("bearer")
    async with SamplerClient(locked.url, api_token=TOKEN) as client:
        assert await client.check_token() is True
    async with SamplerClient(locked.url, api_token="wrong") as client:
        with pytest.raises(Unauthorized):
            await client.check_token()
    locked.stop()
    open_sampler = make_sampler()  # no api_token: nothing is checked
    async with SamplerClient(open_sampler.url, api_token="anything") as client:
        assert await client.check_token() is True
    assert httpx.get(f"{open_sampler.url}/auth", timeout=10).status_code == 204


@pytest.mark.parametrize("token", ["wrong", None])
def test_a_token_the_sampler_refuses_stops_the_trainer_before_the_model_loads(
        make_sampler, tiny_model_dir: Path, tmp_path: Path, capsys, token: str | None) -> None:
    sampler = make_sampler(api_token=TOKEN)
    run_dir = tmp_path / "trainer"
    args = ["--model", str(tiny_model_dir), "--sampler-url", sampler.url, "--run-dir", str(run_dir),
            "--per-device-batch-size", "4", "--grad-accum-steps", "4", "--no-progress"]
    code = trainer_main(args + (["--api-token", token] if token else []), prog="tandem trainer")
    assert code == 2
    line = _last_line(capsys.readouterr().err)
    assert f"the sampler at {sampler.url}" in line and "--api-token / TANDEM_API_TOKEN" in line, line
    assert ("refused the API token" if token else "needs an API token") in line, line
    # Stopped before the model loaded: no start record, nothing published or checkpointed.
    assert not (run_dir / "trainer_metrics.jsonl").exists()
    assert not (run_dir / "published").exists() and not (run_dir / "checkpoints").exists()


async def test_an_unreachable_sampler_is_retried_with_a_line_per_interval(caplog, refused_url: str) -> None:
    caplog.set_level(logging.INFO, logger="tandem.client")
    url = refused_url
    async with SamplerClient(url, retry_for=1.5, report_every=0.4, retry_for_name="--retry-for") as client:
        t0 = time.monotonic()
        with pytest.raises(SamplerUnavailable) as caught:
            await client.status()
        took = time.monotonic() - t0
    assert 1.0 < took < 5, took
    message = str(caught.value)
    assert "GET /status" in message and url in message and "--retry-for = 1.5s" in message, message
    assert "ConnectError" in message, message
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.client"]
    # The first failure at once, then one line per interval (not one per retry: ~10 retries here).
    assert lines[0].startswith(f"GET /status to the sampler at {url} failed (ConnectError"), lines
    assert "retrying for up to" in lines[0] and "--retry-for" in lines[0]
    assert 2 <= len(lines) <= 5, lines
    assert all("still waiting for the sampler" in line and "giving up in" in line for line in lines[1:]), lines


def test_the_cli_gives_up_on_an_unreachable_sampler_in_one_line(tiny_model_dir: Path, tmp_path: Path,
                                                                 refused_url: str) -> None:
    url = refused_url
    done = _cli("--model", str(tiny_model_dir), "--sampler-url", url, "--run-dir", str(tmp_path / "t"),
                "--retry-for", "1.5", "--wait-log-interval", "0.5")
    assert done.returncode == 4, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = _last_line(done.stderr)
    # GET /auth is the trainer's first call (before GET /status, which the token guards too).
    assert last.startswith("tandem trainer: GET /auth: the sampler at " + url), last
    assert "--retry-for / TANDEM_RETRY_FOR = 1.5s; raise it to wait longer" in last, last
    waiting = [line for line in done.stderr.splitlines() if "tandem.client" in line]
    assert waiting and "a line every 0.5s" in waiting[0] and len(waiting) <= 5, done.stderr


async def test_a_batch_wait_says_what_the_sampler_waits_for_then_gives_up_naming_the_bound(
        make_sampler, caplog, refused_url: str) -> None:
    """Every inference server down: the wait logs the sampler's view (servers in rotation, the
    dead one's state) each interval; the sampler's 503 after generation_deadline is retried for
    retry_for, and the error names the bound and carries the sampler's cause."""
    caplog.set_level(logging.INFO, logger="tandem.client")
    dead = refused_url
    sampler = make_sampler(inference_urls=[dead], generation_deadline=1.5, max_poll_timeout=5)
    async with SamplerClient(sampler.url, poll_timeout=5, retry_for=1.5, report_every=0.5,
                             retry_for_name="--retry-for") as client:
        t0 = time.monotonic()
        with pytest.raises(SamplerUnavailable) as caught:
            await client.get_batch(0)
        took = time.monotonic() - t0
    assert took < 15, took
    message = str(caught.value)
    assert "HTTP 503" in message and "batch 0" in message and dead in message, message
    assert "--retry-for = 1.5s" in message, message
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.client"]
    waits = [line for line in lines if line.startswith("waiting for batch 0:")]
    assert waits, lines
    assert "0 of 1 inference server(s) in rotation" in waits[0] and dead in waits[0], waits[0]
    assert "published weights version 0" in waits[0], waits[0]
    # The 503 phase speaks too: its first failure at once, with the sampler's cause.
    assert any("HTTP 503" in line and "retrying for up to" in line for line in lines), lines
    assert len(lines) < 20, lines  # a line per interval, not one per request


async def test_a_slow_batch_is_waited_for_past_retry_for(make_sampler, standin, caplog) -> None:
    """retry_for bounds a failing sampler, not a slow one: 204s are waited through, and spoken of."""
    caplog.set_level(logging.INFO, logger="tandem.client")
    httpx.post(f"{standin.url}/_standin/fail", params={"count": 10**9})  # builds fail: no batch yet
    sampler = make_sampler(generation_deadline=60, max_poll_timeout=5)
    async with SamplerClient(sampler.url, poll_timeout=5, retry_for=0.5, report_every=0.5) as client:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(client.get_batch(0, rank, 2)) for rank in (0, 1)]
        await asyncio.sleep(2.0)
        assert not any(task.done() for task in tasks)
        httpx.post(f"{standin.url}/_standin/fail", params={"count": 0})
        batches = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        took = time.monotonic() - t0
    assert [b.step for b in batches] == [0, 0]
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for batch 0:")]
    # Rank 0 speaks for both, once per interval; rank 1 keeps long-polling quietly.
    assert 2 <= len(waits) <= took / 0.5 + 1, (took, waits)
    metrics = httpx.get(f"{sampler.url}/metrics", timeout=10).text
    polls = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("tandem_sampler_http_requests_total{") and 'route="/batch"' in line)
    assert 2 <= polls <= 2 * (took / 0.5 + 2), (took, polls)  # a poll per interval per rank, not a busy loop
    assert "1 of 1 inference server(s) in rotation" in waits[-1] or "attempt" in waits[-1], waits


def test_the_trl_link_names_the_token_it_lacks(make_sampler) -> None:
    from services.trl_bridge.sampler_link import SamplerLink
    from shared.client import SamplerError

    sampler = make_sampler(api_token=TOKEN)
    for token, needle in (("wrong", "refused the api_token given"), (None, "needs an api_token")):
        link = SamplerLink(sampler.url, api_token=token)
        try:
            with pytest.raises(SamplerError, match=needle) as caught:
                link.check_token()
            assert sampler.url in str(caught.value) and "TANDEM_API_TOKEN" in str(caught.value)
        finally:
            link.close()
    link = SamplerLink(sampler.url, api_token=TOKEN)
    try:
        link.check_token()
    finally:
        link.close()


def test_the_trainer_with_every_inference_server_down_speaks_then_stops_in_one_line(
        make_sampler, tiny_model_dir: Path, tmp_path: Path, capsys, caplog, refused_url: str) -> None:
    caplog.set_level(logging.INFO, logger="tandem.client")
    dead = refused_url
    # generation_deadline counts from the sampler's start, and the trainer must first reach its
    # first GET /batch (a cold torch import and the model load: 3 s alone on a quiet machine) to
    # see 204s and say what it waits for before the 503s begin: 8 s leaves it that room.
    sampler = make_sampler(inference_urls=[dead], generation_deadline=8, max_poll_timeout=5)
    code = trainer_main(["--model", str(tiny_model_dir), "--sampler-url", sampler.url, "--run-dir",
                         str(tmp_path / "t"), "--per-device-batch-size", "4", "--grad-accum-steps", "4",
                         "--no-progress", "--no-eval-at-start", "--no-eval-at-end", "--retry-for", "1.5",
                         "--wait-log-interval", "0.5"], prog="tandem trainer")
    assert code == 4
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = _last_line(err)
    assert line.startswith(f"tandem trainer: GET /batch step=0 rank=0/1: the sampler at {sampler.url} kept failing"), line
    assert "--retry-for / TANDEM_RETRY_FOR = 1.5s; raise it to wait longer" in line, line
    assert "HTTP 503" in line and dead in line, line
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for batch 0:")]
    assert waits and "0 of 1 inference server(s) in rotation" in waits[0] and dead in waits[0], waits


def test_a_batch_the_sampler_will_never_serve_stops_the_trainer_in_one_line(make_sampler, tiny_model_dir: Path,
                                                                           tmp_path: Path, capsys) -> None:
    """Another trainer has moved the run to version 5: this fresh trainer's batch 0 was never sealed
    and never will be (410 superseded). It stops with the sampler's words, not a traceback."""
    sampler = make_sampler(max_poll_timeout=5)

    async def moved_on() -> None:
        async with SamplerClient(sampler.url, poll_timeout=5) as client:
            await client.publish_weights(5)

    asyncio.run(moved_on())
    code = trainer_main(["--model", str(tiny_model_dir), "--sampler-url", sampler.url, "--run-dir",
                         str(tmp_path / "t"), "--per-device-batch-size", "4", "--grad-accum-steps", "4",
                         "--no-progress", "--no-eval-at-start", "--no-eval-at-end"], prog="tandem trainer")
    err = capsys.readouterr().err
    assert code == 7, err
    assert "Traceback" not in err, err
    line = _last_line(err)
    assert line.startswith("tandem trainer: batch 0 is not available: batch 0 was never sealed and will not be: "
                           "version 5 is published"), line
