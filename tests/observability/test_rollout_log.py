"""Rollout log: each sealed batch lands in run_dir/rollouts/step-NNNNNN.parquet (zstd),
and reading it back gives exactly what GET /batch served."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pandas as pd
import pyarrow.parquet as pq

from tests.observability.support import train_steps


def wait_for(path: Path, timeout: float = 15.0) -> Path:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} was not written within {timeout}s"
        time.sleep(0.05)
    return path


def test_parquet_round_trip_matches_get_batch(make_sampler, run_dir):
    sampler = make_sampler(max_staleness=1)
    batches = train_steps(sampler.url, range(3))
    directory = run_dir / "rollouts"
    for batch in batches:
        path = wait_for(directory / f"step-{batch['step']:06d}.parquet")
        meta = pq.ParquetFile(path).metadata
        assert meta.row_group(0).column(0).compression == "ZSTD"
        table = pq.read_table(path)
        stats = json.loads(table.schema.metadata[b"tandem.stats"])
        assert stats["step"] == batch["step"] and stats["num_samples"] == len(batch["samples"])
        rows = table.to_pylist()
        assert len(rows) == len(batch["samples"])
        for row, sample in zip(rows, batch["samples"]):
            assert row["step"] == batch["step"]
            for key in ("prompt_id", "group_id", "sample_index", "env", "prompt_text", "completion_text",
                        "prompt_token_ids", "completion_token_ids", "completion_logprobs", "loss_mask",
                        "reward", "advantage", "policy_version", "finish_reason", "versions", "use_count"):
                assert row[key] == sample[key], key
            assert dict(row["rewards"]) == sample["rewards"]
            assert row["staleness"] == batch["step"] - sample["policy_version"]
            assert row["sealed_at"] == stats["sealed_at"]

    # The directory reads as one dataset (the recipe in docs/dashboard.md, Rollout logs).
    frame = pd.read_parquet(directory)
    # The producer may already have sealed later steps (k = 1): compare steps 0-2.
    frame = frame[frame["step"] < 3]
    assert len(frame) == sum(len(b["samples"]) for b in batches)
    assert not list(directory.glob(".*.tmp")), "temporary files left behind"
    by_step = frame.groupby("step")["reward"].mean()
    for batch in batches:
        expected = sum(s["reward"] for s in batch["samples"]) / len(batch["samples"])
        assert abs(by_step[batch["step"]] - expected) < 1e-9

    status = httpx.get(f"{sampler.url}/status", timeout=10).json()
    assert status["rollout_log"]["directory"] == str(directory)
    assert status["rollout_log"]["files_written"] >= 3
    assert status["rollout_log"]["last_error"] is None

