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

    size = 64 * 1024
    result = bench_handoff.run(tmp_path, sizes=(size,), reps={size: 2}, old_reps={size: 2}, old_sizes=(size,),
                               everysec_sizes=(size,), ceiling_bytes=1 << 20)
    rows = _written(tmp_path, "handoff")["rows"]
    assert {(r["encoding"], r["world_size"], r["appendfsync"]) for r in rows} == {
        ("frames", 1, "always"), ("frames", 8, "always"), ("arrays", 1, "always"), ("msgpack", 1, "always"),
        ("json", 1, "always"), ("frames", 1, "everysec")}
    for row in result["rows"]:
        assert row["samples"] == 8 and row["reps"] == 2 and row["built_to_decoded_p50_s"] > 0
        for key in ("batch_bytes", "sealed_to_decoded_p50_s", "share_p50_s", "sampler_rss_peak_bytes"):
            assert row[key] is not None, key
    assert result["durability_cost"][0]["sealed_to_decoded_p50_s"]["everysec"] is not None
    assert result["ceilings"]["tcp_loopback"]["GB_per_s"] > 0


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

    result = bench_publication.run(tmp_path, models=("tiny",), repeats=1, root=str(tmp_path))
    full, lora = _written(tmp_path, "publication")["rows"]
    assert [full, lora] == result["rows"]
    assert (full["kind"], lora["kind"]) == ("full", "lora")
    assert lora["bytes"] < full["bytes"] and lora["trained_params"] < full["trained_params"]
    assert all(r["write_s"] > 0 and r["load_s"] > 0 for r in (full, lora))
    assert full["swap_probe_apart_s"] > 0 and full["swap_probe_inline_s"] > 0


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_gpu_bench_runs_its_code_path_on_the_cpu(tmp_path, lora_rank):
    """bench/bench_gpu.py is measured on a lent GPU only; its tiny CPU mode keeps the code path
    (set_up_model, Learner, full_state_dict, publish_weights; LoRA: the adapter's gather and
    LoraRun.publish) from rotting in between."""
    from bench import bench_gpu

    out = tmp_path / "out"
    code = bench_gpu.main(["--out", str(out), "--preset", "tiny", "--allow-cpu", "--steps", "2", "--warmup", "1",
                           "--pub-repeats", "1", "--samples", "8", "--prompt-tokens", "8", "--completion-tokens", "8",
                           "--grad-accum", "2", "--gc-grad-accum", "2", "--work-dir", str(tmp_path / "work"),
                           "--lora-rank", str(lora_rank)])
    assert code == 0
    result = json.loads((out / ("gpu_lora.json" if lora_rank else "gpu.json")).read_text())
    assert result["steps"] and all(s["step_s_median"] > 0 and s["tokens_per_s"] > 0 for s in result["steps"])
    assert result["publication"] and all(p["bytes"] > 0 and p["publish_weights_s_median"] >= 0
                                         for p in result["publication"])
    if lora_rank:
        assert result["lora"]["rank"] == lora_rank
        # The adapter alone is published: far fewer bytes than the model's parameters in bf16/f32.
        assert result["trainable_params"] < result["model"]["params"]
        assert all(p["bytes"] < result["model"]["params"] * 2 for p in result["publication"])


def test_overlap(tmp_path):
    from bench import bench_overlap

    result = bench_overlap.run(tmp_path, smoke=True, lrs=(1e-6,), steps=3, root=str(tmp_path))
    written = _written(tmp_path, "overlap-smoke")
    assert written["runs"] == json.loads(json.dumps(result["runs"]))
    before, after = result["runs"]
    assert (before["path"], after["path"]) == ("before", "after")
    assert [v["kind"] for v in before["versions"]] == ["full"] * 3
    assert [v["kind"] for v in after["versions"]] == ["full", "delta", "delta"]
    for run in (before, after):
        assert run["steps"] == 3 and 0 < run["busy_fraction"] <= 1
        for v in run["versions"]:
            assert v["bytes"] > 0 and v["write_s"] > 0 and v["critical_s"] >= 0
            assert [s["probe_ok"] for s in v["servers"]] == [True] and v["servers"][0]["sync_s"] > 0
    assert {t["target"] for t in result["targets"]} >= {"trainer critical-path publication <= 5 % of the step"}
    markdown = (tmp_path / "overlap-smoke.md").read_text()
    assert "MET" in markdown and markdown.count("### cpu, lr 1e-06") == 1
