"""/status carries the observability facts; `tandem status` prints them; the timeline
derivation (training per step from version publish times) is right."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx

from services.sampler.api.views import staleness_histogram, timeline
from tests.observability.support import run_eval, train_steps
from tests.support.servers import REPO


TOKEN = "status-run-token"


def tandem(*args: str, timeout: float = 30, env_token: str | None = None) -> subprocess.CompletedProcess:
    # A wide terminal so rich does not fold the URLs; no TANDEM_SAMPLER_URL or TANDEM_API_TOKEN
    # from the caller, the token in the environment only when `env_token` is given.
    env = {k: v for k, v in os.environ.items() if k not in ("TANDEM_SAMPLER_URL", "TANDEM_API_TOKEN")}
    env |= {"COLUMNS": "160"} | ({"TANDEM_API_TOKEN": env_token} if env_token else {})
    return subprocess.run([sys.executable, "-m", "services.cli", "status", *args], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_status_json_and_tandem_status_output(make_sampler, standin):
    sampler = make_sampler(max_staleness=1)
    train_steps(sampler.url, range(2))
    run_eval(sampler.url, num_examples=3)
    status = httpx.get(f"{sampler.url}/status", timeout=10).json()
    # Existing keys stay (the trainer reads config), new ones are added.
    assert status["config"]["batch_size"] == 16
    assert status["versions"]["published"] == 2
    assert sum(status["staleness"]["histogram"].values()) >= 32
    assert set(status["staleness"]["histogram"]) <= {"0", "1"}
    assert status["rewards"]["last_eval"]["num_examples"] == 3
    assert status["rewards"]["last_batch_mean"] is not None
    assert [row["step"] for row in status["timeline"]][:2] == [0, 1]
    first, second = status["timeline"][:2]
    assert second["train_end"] == status["versions"]["published_at"]  # step 1 ended with version 2
    assert second["train_start"] >= first["train_end"] > first["train_start"] >= first["gen_end"]
    assert "recent_completions_per_second" in status["throughput"]

    done = tandem("--url", sampler.url)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for fact in ("Tandem sampler", sampler.url, "next step", "published version", "batches ready",
                 "in-flight requests", "completions/s", standin.url, "healthy", "recent batches",
                 "last eval reward"):
        assert fact in out, f"{fact!r} missing from:\n{out}"

    watched = tandem("--url", sampler.url, "--watch", "0.1", "--count", "2")
    assert watched.returncode == 0, watched.stderr
    assert "published version" in watched.stdout

    raw = tandem("--url", sampler.url, "--json")
    assert raw.returncode == 0 and '"published": 2' in raw.stdout


def test_tandem_status_sends_the_runs_token_and_says_how_to_pass_it(make_sampler):
    """A sampler started with a token answers GET /status to that token only: `tandem status`
    sends --api-token (or TANDEM_API_TOKEN), and without it or with another says, in one line,
    how to pass it (exit 2, no traceback)."""
    sampler = make_sampler(api_token=TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    batch = httpx.get(f"{sampler.url}/batch", params={"step": 0, "timeout": 30}, headers=auth, timeout=40)
    assert batch.status_code == 200, batch.text[:300]
    published = httpx.post(f"{sampler.url}/weights_version", json={"version": 1, "checkpoint_path": None},
                           headers=auth, timeout=30)
    assert published.status_code == 200, published.text
    assert httpx.get(f"{sampler.url}/status", timeout=10).status_code == 401  # the sampler is closed

    for args, env_token, why in (((), None, "needs the run's token"),
                                 (("--api-token", "not-the-runs"), None, "refuses the token given"),
                                 ((), "not-the-runs", "refuses the token given"),
                                 (("--watch", "0.1", "--count", "2"), None, "needs the run's token"),
                                 (("--json",), None, "needs the run's token")):
        done = tandem("--url", sampler.url, *args, env_token=env_token)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        line = done.stderr.strip()
        assert "\n" not in line and "Traceback" not in line, (args, done.stderr)
        assert line == (f"tandem status: the sampler at {sampler.url} {why}: pass the run's token with "
                        f"--api-token or TANDEM_API_TOKEN (the one the sampler was started with)"), (args, line)
        assert TOKEN not in done.stdout + done.stderr
        assert "published version" not in done.stdout

    done = tandem("--url", sampler.url, "--api-token", TOKEN)
    assert done.returncode == 0, done.stderr
    for fact in ("Tandem sampler", sampler.url, "published version", "recent batches"):
        assert fact in done.stdout, f"{fact!r} missing from:\n{done.stdout}"
    raw = tandem("--url", sampler.url, "--json", env_token=TOKEN)  # the token from TANDEM_API_TOKEN
    assert raw.returncode == 0, raw.stderr
    assert json.loads(raw.stdout)["versions"]["published"] == 1
    watched = tandem("--url", sampler.url, "--watch", "0.1", "--count", "2", env_token=TOKEN)
    assert watched.returncode == 0 and "published version" in watched.stdout, watched.stderr


def test_tandem_status_says_when_the_sampler_is_unreachable():
    done = tandem("--url", "http://127.0.0.1:9", "--timeout", "2")
    assert done.returncode == 1
    assert "cannot reach the sampler at http://127.0.0.1:9" in done.stderr


def test_timeline_derives_training_from_publish_times():
    batches = [
        {"step": 0, "generation_started_at": 0.0, "sealed_at": 2.0, "policy_versions": {"0": 4}},
        {"step": 1, "generation_started_at": 1.0, "sealed_at": 3.0, "policy_versions": {"0": 3, "1": 1}},
        {"step": 2, "generation_started_at": 6.0, "sealed_at": 9.0, "policy_versions": {"1": 4}},
    ]
    rows = timeline(batches, {1: 5.0, 2: 10.0})
    # Step 0 trains from its seal to version 1; step 1 waits for version 1 (its batch was
    # ready at 3); step 2 waits for version 2 (at 10, after its seal at 9) and has not
    # finished (no version 3).
    assert [(r["train_start"], r["train_end"]) for r in rows] == [(2.0, 5.0), (5.0, 10.0), (10.0, None)]
    assert rows[2]["gen_start"] == 6.0 and rows[2]["gen_end"] == 9.0
    assert timeline(batches[2:], {1: 5.0})[0]["train_start"] is None  # version 2 not published yet
    assert staleness_histogram(batches) == {"0": 5, "1": 7}


def test_timeline_takes_training_and_publication_from_the_trainers_metrics():
    """A trainer that publishes in the background sends when its snapshot ended and how long
    each part took; the sampler adds each server's apply seconds (POST /weights_version)."""
    batches = [{"step": 0, "generation_started_at": 0.0, "sealed_at": 2.0},
               {"step": 1, "generation_started_at": 1.0, "sealed_at": 3.0}]
    trainer = [{"version": 1, "train_s": 4.0, "snapshot_s": 0.5, "snapshot_at": 7.0, "write_s": 1.0,
                "written_at": 8.5, "at": 9.0, "apply_s": {"http://a": 0.25, "http://b": 0.5}},
               {"version": 2, "train_s": 3.0}]  # an older trainer's record: derived as before
    rows = timeline(batches, {1: 9.0, 2: 12.0}, trainer)
    assert (rows[0]["train_start"], rows[0]["train_end"]) == (2.5, 6.5)
    assert rows[0]["publish"] == {"snapshot": [6.5, 7.0], "write": [7.5, 8.5], "apply": [8.5, 9.0]}
    assert (rows[1]["train_start"], rows[1]["train_end"], rows[1].get("publish")) == (9.0, 12.0, None)
