"""TandemGRPOTrainer (services/trl_bridge) against the real sampler, the real CPU inference
server and the real tiny model: it learns, it publishes verified versions, it keeps the
contract's staleness rules, it refuses a config that disagrees with the sampler before loading
a model, and it runs as two ranks under `accelerate launch`."""

from __future__ import annotations

import json
import shutil
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

pytest.importorskip("trl", reason="the TRL integration needs the `trl` extra: pip install -e '.[trl]'")

from trl import GRPOConfig  # noqa: E402

from services.trainer import checkpoint as ckpt  # noqa: E402
from services.trl_bridge.agreement import grpo_config_values  # noqa: E402
from services.trl_bridge.sampler_link import SamplerLink  # noqa: E402
from services.trl_bridge.trainer import TandemGRPOTrainer  # noqa: E402
from shared import contract  # noqa: E402
from shared.contract import ContractError  # noqa: E402
from shared.token_guard import bearer_headers  # noqa: E402
from shared.weights_delta import load_state  # noqa: E402
from tests.support.servers import REPO, free_port  # noqa: E402
from tests.trl.conftest import TOKEN  # noqa: E402


def _config(out: Path, sampler_url: str, max_steps: int, per_device: int = 128, **overrides: Any) -> GRPOConfig:
    link = SamplerLink(sampler_url, api_token=TOKEN)
    try:
        status = link.status()
    finally:
        link.close()
    values = {
        "output_dir": str(out), "max_steps": max_steps, "learning_rate": 1e-3, "lr_scheduler_type": "constant",
        "loss_type": "grpo", "beta": 0.0, "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_max": 2.0, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
        "use_cpu": True, "bf16": False, "disable_tqdm": True, "seed": 0,
        **grpo_config_values(status, 1, per_device),
    }
    values.update(overrides)
    return GRPOConfig(**values)


def _served(url: str) -> Any:
    link = SamplerLink(url, api_token=TOKEN)
    try:
        return link._run(link._client.weights_version())
    finally:
        link.close()


def test_learns_the_toy_task_and_publishes_every_version(make_toy_stack, tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    sampler, _ = make_toy_stack(max_staleness=1)
    steps = 8
    trainer = TandemGRPOTrainer(str(tiny_model_dir), args=_config(tmp_path / "out", sampler.url, steps),
                                sampler_url=sampler.url, api_token=TOKEN)
    try:
        before = trainer.evaluate(metric_key_prefix="before")
        trainer.train()
        after = trainer.evaluate(metric_key_prefix="after")
    finally:
        trainer.close()

    # Learning, on greedy evals of 64 held-out prompts: the fresh model never answers `e` or
    # `o`; after a few steps it answers one of them for every number (half right), which is
    # where the demo sits before it learns parity (docs/demo.md).
    assert before["before_reward"] <= 0.1, before
    assert after["after_reward"] >= 0.4, after
    assert before["before_policy_version"] == 0 and after["after_policy_version"] == steps

    # Step N trained on batch N, all of it, within the sampler's staleness bound.
    batches = trainer.tandem_batches
    assert [b["batch_step"] for b in batches] == list(range(steps))
    assert all(b["samples"] == 128 for b in batches)
    for b in batches:
        low = contract.oldest_allowed_version(b["step"], 1)
        assert all(low <= v <= b["step"] for v in b["policy_versions"]), b
    assert batches[0]["policy_versions"] == [0]

    # Version N+1 published after step N, new each time, with a probe every server passed.
    pubs = trainer.tandem_publications
    assert [p["version"] for p in pubs] == list(range(1, steps + 1))
    assert [p["global_step"] for p in pubs] == list(range(1, steps + 1))
    assert all(p["fresh"] and p["probed"] for p in pubs)
    served = _served(sampler.url)
    assert served.version == steps and Path(served.checkpoint_path) == Path(pubs[-1]["path"])
    for server in served.servers:
        assert server.version == steps and server.state == "ok", server
        assert server.probe and server.probe.ok and server.probe.max_abs_diff <= 1e-3, server.probe
    assert [v for v, _ in ckpt.list_published(tmp_path / "out" / "published")] == [steps - 1, steps]

    # TRL's own logging got the steps and the eval (train() starts a fresh log_history, so the
    # eval from before it is in TRL's log output but not in this run's history).
    history = trainer.state.log_history
    assert sum("tandem/staleness_mean" in h for h in history) == steps
    # The mismatch estimates the native trainer reports: k3 >= 0, and tiny where the CPU server
    # computes the trainer's numbers (samples up to one version old here).
    k3 = [h["tandem/mismatch_k3"] for h in history if "tandem/mismatch_k3" in h]
    assert len(k3) == steps and all(0 <= v < 0.05 for v in k3), k3
    assert [h["after_reward"] for h in history if "after_reward" in h] == [after["after_reward"]]


def test_staleness_and_batch_reuse_follow_the_native_rules(make_toy_stack, tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    """On-policy (max_staleness 0) with TRL's num_iterations 2: like the native trainer's two passes
    inside step N, the two optimizer steps over batch N publish one version, N + 1, after the
    second; batch N + 1 is asked for only once version N + 1 is out (no prefetch at
    max_staleness 0), and every sample of batch N comes from version N exactly."""
    sampler, _ = make_toy_stack(max_staleness=0)
    trainer = TandemGRPOTrainer(str(tiny_model_dir),
                                args=_config(tmp_path / "out", sampler.url, 4, num_iterations=2),
                                sampler_url=sampler.url, api_token=TOKEN, probe_tokens=0)
    try:
        trainer.train()
    finally:
        trainer.close()

    batches, pubs = trainer.tandem_batches, trainer.tandem_publications
    assert [(b["global_step"], b["step"]) for b in batches] == [(0, 0), (2, 1)]
    assert [b["policy_versions"] for b in batches] == [[0], [1]]
    assert all(b["staleness_min"] == b["staleness_max"] == 0 for b in batches)
    assert [(p["global_step"], p["version"]) for p in pubs] == [(2, 1), (4, 2)]
    assert batches[1]["fetched_at"] > pubs[0]["at"]
    assert _served(sampler.url).version == 2


def test_refuses_a_config_that_disagrees_with_the_sampler(make_sampler, tmp_path: Path) -> None:
    """Checked against GET /status before any model is loaded (the model path does not exist),
    each refusal naming the numbers."""
    sampler = make_sampler(prompts_per_step=4, num_generations=4, num_iterations=2, temperature=1.0)
    missing_model = str(tmp_path / "no-model-here")
    base = {"output_dir": str(tmp_path / "out"), "max_steps": 2, "use_cpu": True, "bf16": False, "report_to": "none",
            "num_generations": 4, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4}
    cases = [
        ({"gradient_accumulation_steps": 3},
         ["per_device_batch_size (4) x grad_accum_steps (3) x world_size (1) = 12",
          "prompts_per_step (4) x num_generations (4) = 16", "--grad-accum-steps 4"]),
        ({"num_iterations": 2}, ["num_iterations 2", "each batch would be trained on 4 times"]),
        ({"temperature": 0.7}, ["temperature 0.7", "sampler's 1.0"]),
        ({"num_generations": 2, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2},
         ["num_generations mismatch", "num_generations=4"]),
        ({"use_vllm": True}, ["use_vllm=True"]),
    ]
    for overrides, words in cases:
        args = GRPOConfig(**{**base, **overrides})
        with pytest.raises(ContractError) as refused:
            TandemGRPOTrainer(missing_model, args=args, sampler_url=sampler.url)
        for word in words:
            assert word in str(refused.value), (overrides, str(refused.value))

    # TRL scores the full distribution: a truncating sampler is refused, naming its settings.
    # Another run, so in a namespace of its own (a sampler refuses one holding another run).
    truncating = make_sampler(prompts_per_step=4, num_generations=4, temperature=1.0, top_p=0.9, top_k=20,
                              namespace=f"{sampler.settings.namespace}-truncating")
    with pytest.raises(ContractError) as refused:
        TandemGRPOTrainer(missing_model, args=GRPOConfig(**base), sampler_url=truncating.url)
    assert "top_k 20, top_p 0.9" in str(refused.value) and "TRL's GRPOTrainer" in str(refused.value)


@pytest.mark.slow  # ~45 s: two processes each loading TRL
def test_two_ranks_under_accelerate_launch(make_toy_stack, tiny_model_dir: Path, tmp_path: Path) -> None:
    """examples/trl_grpo.py as two CPU ranks (gloo): each rank trains on its half of every batch,
    whole groups, and rank 0 publishes each version."""
    sampler, _ = make_toy_stack(max_staleness=1)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()),
            str(REPO / "examples" / "trl_grpo.py"), "--sampler-url", sampler.url, "--model", str(tiny_model_dir),
            "--max-steps", "2", "--output-dir", str(out), "--api-token", TOKEN, "--torch-threads", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "ACCELERATE_"))}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(argv, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2
    # Rank 0's share: half of 8 x 16, i.e. 4 whole groups of 16.
    assert [(b["batch_step"], b["samples"]) for b in summary["batches"]] == [(0, 64), (1, 64)]
    assert [(p["version"], p["fresh"], p["probed"]) for p in summary["publications"]] == [(1, True, True),
                                                                                          (2, True, True)]
    assert isinstance(summary["eval_reward_before"], float) and isinstance(summary["eval_reward_after"], float)
    served = _served(sampler.url)
    assert served.version == 2 and all(s.version == 2 and s.state == "ok" for s in served.servers)


def test_staleness_is_the_native_trainers_on_the_same_sampler_settings(make_toy_stack, tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    """The native trainer and TandemGRPOTrainer, each against a fresh sampler with the same settings
    (batches reused twice by the sampler, max_staleness 0: the versions are then determined; two
    micro-batches accumulated per optimizer step on both sides), see
    the same staleness step by step and end on the same version. Batch 1 serves batch 0's samples
    again (staleness 1); batch 2 waits for version 2, published after step 1."""
    import asyncio

    from services.trainer.config import TrainerSettings
    from services.trainer.trainer import train
    from shared.settings import build

    steps, shape = 4, {"prompts_per_step": 2, "num_generations": 4, "num_iterations": 2, "max_staleness": 0}

    native_sampler, _ = make_toy_stack(**shape)
    run_dir = tmp_path / "native"
    settings = build(TrainerSettings, {k: str(v) for k, v in {
        "model": tiny_model_dir, "sampler_url": native_sampler.url, "run_dir": run_dir, "api_token": TOKEN,
        "per_device_batch_size": 4, "grad_accum_steps": 2, "max_steps": steps, "learning_rate": 1e-3,
        "progress": False}.items()})
    asyncio.run(train(settings))
    records = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    native = [(r["step"], r["staleness_mean"], r["staleness_max"]) for r in records if r["event"] == "step"]

    trl_sampler, _ = make_toy_stack(**shape)
    trainer = TandemGRPOTrainer(str(tiny_model_dir), args=_config(tmp_path / "trl", trl_sampler.url, steps, 4),
                                sampler_url=trl_sampler.url, api_token=TOKEN, probe_tokens=0)
    try:
        trainer.train()
    finally:
        trainer.close()
    trl = [(b["step"], b["staleness_min"], b["staleness_max"]) for b in trainer.tandem_batches]

    assert native == [(0, 0.0, 0), (1, 1.0, 1), (2, 0.0, 0), (3, 1.0, 1)]
    # Every sample of a batch has the same staleness here, so TRL's (min, max) is the native (mean, max).
    assert trl == native
    assert _served(native_sampler.url).version == _served(trl_sampler.url).version == steps


@pytest.mark.parametrize("skip", [True, False])
def test_a_step_without_signal_leaves_the_weights_alone(make_toy_stack, tiny_model_dir: Path, tmp_path: Path,
                                                        skip: bool) -> None:
    """Every completion scores the same (ConstEnv), so no batch has an advantage. With weight decay on,
    an AdamW step would still shrink the weights; skipped (the default, as the native trainer does),
    the published weights are the starting ones bit for bit, and the steps are counted. With
    `skip_steps_without_signal=False` (TRL's own behaviour) they move: the check can fail."""
    from safetensors.torch import load_file

    sampler, _ = make_toy_stack(env="tests.support.envs:ConstEnv", prompts_per_step=2, num_generations=4,
                                eval_examples=4)
    trainer = TandemGRPOTrainer(str(tiny_model_dir), args=_config(tmp_path / "out", sampler.url, 2, 8,
                                                                 weight_decay=0.1),
                                sampler_url=sampler.url, api_token=TOKEN, probe_tokens=0,
                                skip_steps_without_signal=skip)
    try:
        trainer.train()
    finally:
        trainer.close()

    assert all(b["reward_mean"] == 1.0 for b in trainer.tandem_batches)
    assert trainer.skipped_steps_no_signal == (2 if skip else 0)
    start = load_file(tiny_model_dir / "model.safetensors")
    final, _ = load_state(trainer.tandem_publications[-1]["path"])  # whole, or a delta's chain replayed
    unchanged = [name for name in start if torch.equal(start[name], final[name].to(start[name].dtype))]
    if skip:
        assert len(unchanged) == len(start)
    else:
        assert len(unchanged) < len(start) // 2
    records = [json.loads(line) for line in (tmp_path / "out" / "trainer_metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_no_signal"] for r in records if r["event"] == "step"] == [skip, skip]


def test_resume_from_a_trl_checkpoint_continues_with_the_next_batch(make_toy_stack, tiny_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    """TRL's own checkpoints: a run saved after optimizer step 2 that went on to version 4 (as if
    killed before its next save) and is resumed with `train(resume_from_checkpoint=True)`
    announces version 2 again, then trains on batches 2, 3 and 4, the ones an uninterrupted
    run would have used: with keep_batches 1 only the resume step it sent with each version
    (2, once checkpoint-2 was written) kept batch 2 for it."""
    sampler, _ = make_toy_stack(prompts_per_step=2, num_generations=4, eval_examples=4, keep_batches=1)
    out = tmp_path / "out"
    first = TandemGRPOTrainer(str(tiny_model_dir), args=_config(out, sampler.url, 4, 8, save_strategy="steps",
                                                               save_steps=2),
                              sampler_url=sampler.url, api_token=TOKEN, probe_tokens=0)
    try:
        first.train()
    finally:
        first.close()
    assert (out / "checkpoint-2").is_dir()
    shutil.rmtree(out / "checkpoint-4")  # killed before it was written
    status = httpx.get(f"{sampler.url}/status", timeout=30, headers=bearer_headers(TOKEN)).json()
    assert status["versions"]["published"] == 4 and status["steps"]["resume_step"] == 2
    assert status["steps"]["trimmed_below"] == 2  # held; keep_batches 1 alone would delete batch 2

    second = TandemGRPOTrainer(str(tiny_model_dir), args=_config(out, sampler.url, 5, 8, save_strategy="no"),
                               sampler_url=sampler.url, api_token=TOKEN, probe_tokens=0)
    # Versions 2 and 3 announced again are refused (the sampler serves 4; 4 itself is accepted
    # again): pruning to keep_published 2 must spare the served version-4 on disk meanwhile.
    served_on_disk: list[bool] = []
    publish = second.publisher.publish

    def publish_then_look(*args: Any, **kwargs: Any) -> dict[str, Any]:
        info = publish(*args, **kwargs)
        served_path = _served(sampler.url).checkpoint_path
        served_on_disk.append(served_path is not None and Path(served_path).is_dir())
        return info

    second.publisher.publish = publish_then_look
    try:
        second.train(resume_from_checkpoint=True)
    finally:
        second.close()
    assert [b["batch_step"] for b in second.tandem_batches] == [2, 3, 4]
    assert [p["version"] for p in second.tandem_publications] == [2, 3, 4, 5]
    assert [p["fresh"] for p in second.tandem_publications] == [False, False, True, True]
    assert served_on_disk == [True] * 4
    assert _served(sampler.url).version == 5


class _NaNLossAtStep1(TandemGRPOTrainer):
    """A numerical blow-up on optimizer step 1 only: the loss (hence every gradient) is NaN."""

    def _compute_loss(self, model: Any, inputs: Any) -> Any:
        loss = super()._compute_loss(model, inputs)
        return loss * float("nan") if self.state.global_step == 1 else loss


def test_a_non_finite_gradient_skips_the_step(make_toy_stack, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Step 1's gradients are NaN: that step leaves the weights as step 0 left them (version 2 ==
    version 1, bit for bit, no NaN published), it is counted and logged, and step 2 trains on."""
    # CountEnv's rewards vary within a group (output length), so every batch has signal.
    sampler, _ = make_toy_stack(env="tests.support.envs:CountEnv", prompts_per_step=2, num_generations=4,
                                eval_examples=4)
    trainer = _NaNLossAtStep1(str(tiny_model_dir), args=_config(tmp_path / "out", sampler.url, 3, 8),
                              sampler_url=sampler.url, api_token=TOKEN, probe_tokens=0, keep_published=3)
    try:
        trainer.train()
    finally:
        trainer.close()

    assert trainer.skipped_steps_non_finite == 1
    v1, v2, v3 = (load_state(p["path"])[0] for p in trainer.tandem_publications)
    assert all(torch.equal(v1[n], v2[n]) for n in v1)
    assert all(torch.isfinite(t).all() for t in v3.values())
    assert trainer.skipped_steps_no_signal == 0
    assert any(not torch.equal(v2[n], v3[n]) for n in v2)
    records = [json.loads(line) for line in (tmp_path / "out" / "trainer_metrics.jsonl").read_text().splitlines()]
    assert [r["grad_norm"] is None for r in records if r["event"] == "step"] == [False, True, False]
