"""Every benchmark runs end to end with tiny parameters, so benchmark code cannot rot.

The numbers are meaningless at these sizes; only the shape of the results is checked.
Results go to a temporary directory, never to bench/results.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def _written(tmp_path, name):
    assert (tmp_path / f"{name}.md").read_text().startswith("# ")
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_pipeline(tmp_path):
    from bench import bench_pipeline

    result = bench_pipeline.run(tmp_path, train_seconds=0.1, ratios=(1.0,), max_staleness_values=(0, 1),
                                steps=4, warmup=1, calibration_steps=3, max_tokens=4, prompts_per_step=2, num_generations=2)
    assert _written(tmp_path, "pipeline")["rows"] == result["rows"]
    assert {r["max_staleness"] for r in result["rows"]} == {0, 1}
    assert all(r["seconds_per_step_median"] > 0 for r in result["rows"])


def test_handoff(tmp_path):
    from bench import bench_handoff

    result = bench_handoff.run(tmp_path, sizes=(64 * 1024,), reps={64 * 1024: 2}, everysec_sizes=(64 * 1024,))
    assert {(r["encoding"], r["appendfsync"]) for r in _written(tmp_path, "handoff")["rows"]} == {
        ("arrays", "always"), ("msgpack", "always"), ("json", "always"), ("arrays", "everysec")}
    assert all(r["p50_ms"] > 0 and r["samples"] == 8 and r["reps"] == 2 for r in result["rows"])
    assert result["durability_cost"][0]["p50_ms"]["everysec"] > 0


def test_throughput(tmp_path):
    from bench import bench_throughput

    result = bench_throughput.run(tmp_path, steps=4, warmup=1, repeats=1, prompts_per_step=4, num_generations=4)
    assert _written(tmp_path, "throughput")["median"]["completions_per_s"] > 0
    assert result["runs"][0]["sampler_cpu_us_per_completion"] > 0


def test_memory(tmp_path):
    from bench import bench_memory

    result = bench_memory.run(tmp_path, steps=20, every=10, keep_batches=2, prompts_per_step=2, num_generations=2)
    assert [s["step"] for s in _written(tmp_path, "memory")["samples"]] == [0, 10, 20]
    assert result["batch_keys_max"] <= 2 + 3


def test_stack(tmp_path):
    from bench import bench_stack

    result = bench_stack.run(tmp_path, steps=3, warmup=1, prompts_per_step=2, num_generations=2, backends=("cpu",))
    assert [r["max_staleness"] for r in _written(tmp_path, "stack")["rows"]] == [0, 1]
    assert result["rows"][1]["staleness_mean"] <= 1



def test_publication(tmp_path):
    from bench import bench_publication

    result = bench_publication.run(tmp_path, hidden=64, layers=1, vocab=128, repeats=1, roots=(str(tmp_path),))
    (row,) = _written(tmp_path, "publication")["rows"]
    assert row == result["rows"][0]
    assert row["bytes_per_step_after"] < row["bytes_per_step_before"]
