"""The trainer against the real sampler (a subprocess, embedded Redis) and the real CPU
inference server (in-process, serving the tiny model and reloading every checkpoint).

The sampler runs `tests.trainer.letter_env:LetterEnv`, so these tests depend only on the
sampler's environment interface, not on a particular built-in task.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from services.trainer import checkpoint as ckpt
from services.trainer.config import TrainerSettings
from services.trainer.entrypoint import main as trainer_main
from services.trainer.step_record import batch_digest
from services.trainer.trainer import train
from shared.client import SamplerClient
from shared.settings import SettingsError, build
from shared.token_guard import bearer_headers
from tests.support.servers import REPO, free_port
from tests.trainer.conftest import STACK_ENV, STACK_TOKEN

ENV, TOKEN = STACK_ENV, STACK_TOKEN  # the stack fixtures' (conftest.py)


def _settings(tiny_model_dir: Path, sampler, run_dir: Path, **overrides) -> TrainerSettings:
    values = {"model": tiny_model_dir, "sampler_url": sampler.url, "run_dir": run_dir, "api_token": TOKEN,
              "per_device_batch_size": 4, "grad_accum_steps": 2, "max_steps": 3, "learning_rate": 1e-3,
              "progress": False, "keep_checkpoints": 2}
    values.update(overrides)
    return build(TrainerSettings, {k: str(v) for k, v in values.items()})


def _records(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "trainer_metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


async def _digests(url: str, steps) -> list[str]:
    async with SamplerClient(url, api_token=TOKEN) as client:
        return [batch_digest(await client.get_batch(step, timeout=60)) for step in steps]


async def test_trains_checkpoints_publishes_and_evaluates(stack, tiny_model_dir: Path, tmp_path: Path) -> None:
    sampler, _ = stack
    run_dir = tmp_path / "trainer"
    summary = await train(_settings(tiny_model_dir, sampler, run_dir, eval_every=2, progress=True))

    assert summary["steps"] == 3 and summary["final_version"] == 3
    assert summary["eval_reward_before"] is not None and summary["eval_reward_after"] is not None
    assert [e["label"] for e in summary["evals"]].count("periodic") == 1
    assert 0.0 <= summary["trainer_wait_fraction"] <= 1.0
    assert json.loads((run_dir / "trainer_summary.json").read_text())["final_version"] == 3

    steps = _records(run_dir, "step")
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert r["samples"] == 8 and r["loss_tokens"] > 0 and r["grad_norm"] >= 0
        assert 0 <= r["staleness_max"] <= 1  # max_staleness = 1
        assert 0 < r["is_weight_max"] <= 2.0
    # Samples produced by the very weights being trained have no behaviour mismatch.
    assert steps[0]["staleness_max"] == 0 and steps[0]["behaviour_mismatch"] < 1e-4
    # It trained on exactly the sampler's batches 0..2.
    assert [r["batch_digest"] for r in steps] == await _digests(sampler.url, range(3))

    # Every step published its weights (keep_published = 2: versions 2 and 3 remain); the
    # one full checkpoint (checkpoint_every = 10) is the last step's. The newest version is 3
    # and the sampler loaded it everywhere.
    published = run_dir / "published"
    assert [v for v, _ in ckpt.list_published(published)] == [2, 3]
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [2]
    async with SamplerClient(sampler.url, api_token=TOKEN) as client:
        served = await client.weights_version()
    assert served.version == 3
    assert Path(served.checkpoint_path) == ckpt.version_path(published, 3)
    assert all(server.version == 3 for server in served.servers), served.servers
    # Publication writes weights only; the optimizer state goes with the full checkpoint.
    assert sorted(p.name for p in ckpt.version_path(published, 3).iterdir()) == [
        "config.json", "model.safetensors", ckpt.PUBLISHED_FILE]
    assert all(r["published_bytes"] > 0 for r in steps)
    assert [r["checkpoint_bytes"] > 0 for r in steps] == [False, False, True]

    from safetensors.torch import load_file

    start = load_file(tiny_model_dir / "model.safetensors")
    final = load_file(ckpt.version_path(published, 3) / "model.safetensors")
    changed = [name for name in start if not torch.equal(start[name], final[name])]
    assert len(changed) == len(start), sorted(set(start) - set(changed))
    # The published version is the checkpoint's weights (float32 on CPU: publish_dtype auto).
    saved = load_file(ckpt.step_path(run_dir, 2) / "model.safetensors")
    assert all(torch.equal(final[name], saved[name]) for name in final)


async def test_resume_continues_with_the_same_batches(stack, tiny_model_dir: Path, tmp_path: Path) -> None:
    sampler, _ = stack
    run_dir = tmp_path / "trainer"
    first = await train(_settings(tiny_model_dir, sampler, run_dir, max_steps=2, eval_at_end=False))
    assert first["final_version"] == 2
    step1 = ckpt.step_path(run_dir, 1)
    # What any trainer gets for steps 2 and 3 from this sampler (batches are keyed by step).
    expected = await _digests(sampler.url, range(2, 4))

    second = await train(_settings(tiny_model_dir, sampler, run_dir, max_steps=4, eval_at_start=False))
    assert second["start_step"] == 2 and second["steps"] == 2 and second["final_version"] == 4
    starts = _records(run_dir, "start")
    assert starts[-1]["resumed_from"] == str(step1) and starts[-1]["start_step"] == 2
    steps = _records(run_dir, "step")
    assert [r["step"] for r in steps] == [0, 1, 2, 3]  # nothing repeated, nothing skipped
    assert [r["batch_digest"] for r in steps[2:]] == expected
    # The resumed run continued AdamW from the saved state: step counts keep growing.
    state = torch.load(ckpt.step_path(run_dir, 3) / ckpt.OPTIMIZER_FILE)
    assert all(s["step"] == 4 for s in state["state"].values())


async def test_resume_from_an_older_full_checkpoint_retrains_the_steps_since(stack, tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    """Publication is every step, full checkpoints every `checkpoint_every`: a trainer that dies
    between the two resumes from the older checkpoint, while the sampler already serves newer
    versions. It trains those steps again on the same batches (the sampler keeps them) and the
    sampler's version never goes backwards."""
    import shutil

    sampler, _ = stack
    run_dir = tmp_path / "trainer"
    await train(_settings(tiny_model_dir, sampler, run_dir, max_steps=3, checkpoint_every=2,
                          eval_at_start=False, eval_at_end=False))
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [1, 2]
    shutil.rmtree(ckpt.step_path(run_dir, 2))  # as if it died before the last checkpoint
    async with SamplerClient(sampler.url, api_token=TOKEN) as client:
        assert (await client.weights_version()).version == 3

    summary = await train(_settings(tiny_model_dir, sampler, run_dir, max_steps=4, checkpoint_every=2,
                                    eval_at_start=False, eval_at_end=False))
    assert summary["start_step"] == 2 and summary["final_version"] == 4
    steps = _records(run_dir, "step")
    # One record per step: the dead run's step 2 is moved out of the way, the new one says so.
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert [r.get("retrained", False) for r in steps] == [False, False, True, False]
    superseded = [json.loads(line) for line in (run_dir / "trainer_metrics.superseded.jsonl").read_text().splitlines()]
    assert [r["step"] for r in superseded] == [2]
    assert superseded[0]["batch_digest"] == steps[2]["batch_digest"]  # the same batch 2, trained again
    async with SamplerClient(sampler.url, api_token=TOKEN) as client:
        served = await client.weights_version()
    assert served.version == 4 and all(server.version == 4 for server in served.servers)
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [1, 3]


async def test_a_new_run_in_a_used_run_dir_keeps_what_it_publishes(stack, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A run directory holding an older run's version-59/60 and checkpoint step-59: a new run
    (--no-resume) prunes those first, never its own newest version or the one the sampler
    serves, resumes later from its own checkpoint, and moves the old metrics file aside."""
    from transformers import AutoModelForCausalLM

    sampler, _ = stack
    run_dir = tmp_path / "trainer"
    old = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    for version in (59, 60):
        ckpt.publish_weights(run_dir / "published", version, old.state_dict(), old.config, dtype=torch.float32,
                             step=version - 1)
    ckpt.save_checkpoint(run_dir, 59, old)
    (run_dir / "trainer_metrics.jsonl").write_text(json.dumps({"event": "step", "step": 59}) + "\n")

    summary = await train(_settings(tiny_model_dir, sampler, run_dir, max_steps=3, checkpoint_every=2,
                                    keep_published=1, keep_checkpoints=1, resume=False,
                                    eval_at_start=False, eval_at_end=False))
    assert summary["start_step"] == 0 and summary["final_version"] == 3
    async with SamplerClient(sampler.url, api_token=TOKEN) as client:
        served = await client.weights_version()
    assert served.version == 3 and Path(served.checkpoint_path).is_dir()
    assert [v for v, _ in ckpt.list_published(run_dir / "published")] == [3]
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [2]
    assert [r["step"] for r in _records(run_dir, "step")] == [0, 1, 2]
    archived = [p for p in run_dir.glob("trainer_metrics.*.jsonl") if "superseded" not in p.name]
    assert len(archived) == 1 and '"step": 59' in archived[0].read_text()

    # Resuming it continues from its own checkpoint (step-2), not the old run's step-59.
    summary = await train(_settings(tiny_model_dir, sampler, run_dir, max_steps=4, checkpoint_every=2,
                                    keep_published=1, eval_at_start=False, eval_at_end=False))
    assert summary["start_step"] == 3 and summary["final_version"] == 4
    assert [r["step"] for r in _records(run_dir, "step")] == [0, 1, 2, 3]


async def test_a_trainer_that_cannot_continue_the_samplers_run_says_so_before_training(stack, tiny_model_dir: Path,
                                                                                      tmp_path: Path) -> None:
    """A sampler 12 versions into a run whose early batches are gone, and a trainer with no
    checkpoint (a new --run-dir): refused at start-up with the way out, not a 410 at step 0."""
    sampler, _ = stack
    async with SamplerClient(sampler.url, api_token=TOKEN) as client:
        await client.publish_weights(12, None, resume_step=12)
    with pytest.raises(SettingsError) as refused:
        await train(_settings(tiny_model_dir, sampler, tmp_path / "new", eval_at_start=False, eval_at_end=False))
    message = str(refused.value)
    assert "cannot continue from step 0 (no checkpoint in --run-dir)" in message
    assert "deleted its batches below step 4" in message and "--fresh" in message and "--no-resume" in message
    assert not (tmp_path / "new" / "trainer_metrics.jsonl").exists()


def test_cli_refuses_a_batch_shape_mismatch(stack, tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    sampler, _ = stack
    code = trainer_main(["--model", str(tiny_model_dir), "--sampler-url", sampler.url, "--api-token", TOKEN,
                         "--run-dir", str(tmp_path / "t"), "--per-device-batch-size", "3",
                         "--grad-accum-steps", "2", "--no-progress"], prog="tandem trainer")
    assert code == 2
    err = capsys.readouterr().err
    for needle in ("per_device_batch_size (3)", "grad_accum_steps (2)", "world_size (1)", "= 6",
                   "prompts_per_step (2)", "num_generations (4)", "= 8"):
        assert needle in err, (needle, err)
    assert not (tmp_path / "t" / "checkpoints").exists()


async def test_scores_the_truncated_distribution_a_sampler_samples_from(make_stack, tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    """top_k / top_p < 1: the inference server reports logprobs renormalised over the truncated
    set, and the trainer scores the same set (shared/truncation.py), so on-policy samples have no
    behaviour mismatch. Scoring the full distribution instead would be off by ~0.1 nats a token."""
    sampler, _ = make_stack(max_staleness=0, top_p=0.8, top_k=12)
    config = httpx.get(sampler.url + "/status", timeout=30, headers=bearer_headers(TOKEN)).json()["config"]
    assert (config["top_p"], config["top_k"]) == (0.8, 12)
    run_dir = tmp_path / "trainer"
    summary = await train(_settings(tiny_model_dir, sampler, run_dir, max_steps=2, eval_at_start=False,
                                    eval_at_end=False))
    assert summary["final_version"] == 2
    (start,) = _records(run_dir, "start")
    assert start["truncation"] == "top_k 12, top_p 0.8"
    steps = _records(run_dir, "step")
    for r in steps:
        assert r["staleness_max"] == 0
        assert r["behaviour_mismatch"] < 1e-4, r
        assert r["outside_truncation_fraction"] == 0.0, r

    # The settings do truncate: batch 0 (version 0, the starting weights) scored over the full
    # distribution is far from the sampler's logprobs, and over the truncated one it is not.
    from transformers import AutoModelForCausalLM

    from services.trainer.collate import split_micro_batches
    from services.trainer.learner import forward_logprobs
    from shared.contract import Truncation

    async with SamplerClient(sampler.url, api_token=TOKEN) as client:
        batch = await client.get_batch(0, timeout=60)
    (mb,) = split_micro_batches(batch.samples, 1)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    mask = mb.loss_mask > 0

    def mismatch(truncation: Truncation | None) -> float:
        with torch.no_grad():
            logp = forward_logprobs(model, mb, 1.0, truncation=truncation)
        return float((logp - mb.behaviour_logprobs).abs()[mask].mean())

    truncated, full = mismatch(Truncation(top_k=12, top_p=0.8)), mismatch(None)
    print(f"batch 0 mismatch: truncated {truncated:.2g}, full distribution {full:.2g}")
    assert truncated < 1e-4 and full > 0.05


def _torchrun(sampler, tiny_model_dir: Path, run_dir: Path, *flags: str) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "services.cli", "trainer", "--model", str(tiny_model_dir), "--sampler-url", sampler.url,
            "--api-token", TOKEN, "--run-dir", str(run_dir), "--per-device-batch-size", "2",
            "--grad-accum-steps", "2", "--learning-rate", "1e-3", "--device", "cpu",
            "--no-progress", "--no-eval-at-start", "--no-eval-at-end", *flags]
    # The caller's TANDEM_* variables would override the flags' defaults in both ranks.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(argv, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_two_ranks_under_torchrun(stack, tiny_model_dir: Path, tmp_path: Path) -> None:
    sampler, _ = stack
    run_dir = tmp_path / "trainer"
    _torchrun(sampler, tiny_model_dir, run_dir, "--max-steps", "2", "--sharding", "ddp")

    steps = _records(run_dir, "step")
    assert [r["step"] for r in steps] == [0, 1]
    assert all(r["samples"] == 8 for r in steps)  # both ranks' shares, reduced
    assert _records(run_dir, "start")[0]["world_size"] == 2
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [1]
    served = asyncio.run(_served_version(sampler.url))
    assert served == 2


@pytest.mark.slow
def test_fsdp_two_ranks_publish_checkpoint_and_resume_sharded(stack, tiny_model_dir: Path, tmp_path: Path) -> None:
    """FSDP2 over 2 gloo ranks: each rank holds half of every parameter and of the AdamW state.
    The published weights are the gathered whole; the full checkpoint's optimizer state is
    written shard by shard, and a second torchrun resumes from it."""
    sampler, _ = stack
    run_dir = tmp_path / "trainer"
    _torchrun(sampler, tiny_model_dir, run_dir, "--max-steps", "2", "--sharding", "fsdp", "--checkpoint-every", "1")
    assert _records(run_dir, "start")[0]["sharding"] == "fsdp"
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [0, 1]
    step1 = ckpt.step_path(run_dir, 1)
    assert (step1 / "optimizer").is_dir() and not (step1 / ckpt.OPTIMIZER_FILE).exists()
    from safetensors.torch import load_file

    published = load_file(ckpt.version_path(run_dir / "published", 2) / "model.safetensors")
    saved = load_file(step1 / "model.safetensors")
    start = load_file(tiny_model_dir / "model.safetensors")
    assert published.keys() == start.keys()
    for name, tensor in published.items():
        assert tensor.shape == start[name].shape, name  # whole, not a shard
        assert torch.equal(tensor, saved[name]), name
    assert not all(torch.equal(published[n], start[n]) for n in start)

    _torchrun(sampler, tiny_model_dir, run_dir, "--max-steps", "3", "--sharding", "fsdp", "--checkpoint-every", "1")
    starts = _records(run_dir, "start")
    assert starts[-1]["start_step"] == 2 and starts[-1]["resumed_from"] == str(step1)
    assert [r["step"] for r in _records(run_dir, "step")] == [0, 1, 2]
    assert asyncio.run(_served_version(sampler.url)) == 3


async def _served_version(url: str) -> int:
    async with SamplerClient(url, api_token=TOKEN) as client:
        return (await client.weights_version()).version


@pytest.mark.slow
def test_sigkill_mid_run_then_resume(stack, tiny_model_dir: Path, tmp_path: Path) -> None:
    """kill -9 the trainer process as soon as it has a checkpoint; a restart finishes the run
    on the sampler's batches, re-announcing the newest checkpoint's version if the kill
    landed between saving and publishing."""
    from tests.support.servers import ServiceProcess

    sampler, _ = stack
    run_dir = tmp_path / "trainer"
    argv = [sys.executable, "-m", "services.cli", "trainer", "--model", str(tiny_model_dir),
            "--sampler-url", sampler.url, "--api-token", TOKEN, "--run-dir", str(run_dir),
            "--per-device-batch-size", "4", "--grad-accum-steps", "2", "--max-steps", "50",
            "--checkpoint-every", "1", "--no-progress", "--no-eval-at-start", "--no-eval-at-end"]
    proc = ServiceProcess(argv, name="trainer", log_path=tmp_path / "trainer.log",
                          env={"OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 60
    while ckpt.latest_checkpoint(run_dir) is None:
        assert proc.popen.poll() is None, proc.log_tail()
        assert time.monotonic() < deadline, proc.log_tail()
        time.sleep(0.02)
    proc.kill()
    killed_at = ckpt.latest_checkpoint(run_dir)[0]
    assert killed_at < 49, "the run finished before the kill; nothing was tested"

    final = killed_at + 3
    summary = asyncio.run(train(_settings(tiny_model_dir, sampler, run_dir, max_steps=final, checkpoint_every=1,
                                          eval_at_start=False, eval_at_end=False)))
    assert summary["start_step"] == killed_at + 1 and summary["final_version"] == final
    steps = _records(run_dir, "step")
    recorded = [r["step"] for r in steps]
    # One record per step, none missing: a step whose line the kill pre-empted gets it back
    # from its checkpoint, and is not trained again.
    assert recorded == list(range(final)), recorded
    assert [r["step"] for r in steps if r.get("retrained")] == []
    assert [r["batch_digest"] for r in steps] == asyncio.run(_digests(sampler.url, recorded))
    assert asyncio.run(_served_version(sampler.url)) == final


class RecordingClient(SamplerClient):
    """The real client; remembers every batch it got and every POST /weights_version body it sent.
    With `shift`, it adds that many nats to every behaviour logprob it hands the trainer: the
    trainer then sees what it would see if the inference servers computed with other weights."""

    def __init__(self, *args, shift: float = 0.0, no_signal_steps: tuple[int, ...] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shift = shift
        self.no_signal_steps = no_signal_steps  # these batches reach the trainer with every advantage 0
        self.batches: dict[int, object] = {}
        self.published: list[dict] = []

    async def _request(self, method: str, path: str, what: str, **kwargs):
        if method == "POST" and path == "/weights_version":
            self.published.append(kwargs["json"])
        return await super()._request(method, path, what, **kwargs)

    async def get_batch(self, step: int, *args, **kwargs):
        batch = await super().get_batch(step, *args, **kwargs)
        if self.shift:
            from shared import codec

            batch = batch.model_copy(update={"samples": [
                s.model_copy(update={"completion_logprobs": [x + self.shift for x in codec.plain(s.completion_logprobs)]})
                for s in batch.samples]})
        if step in self.no_signal_steps:
            batch = batch.model_copy(update={"samples": [s.model_copy(update={"advantage": 0.0})
                                                         for s in batch.samples]})
        self.batches[step] = batch
        return batch


@pytest.mark.timeout(180)
async def test_publishes_a_probe_the_servers_pass_and_the_step_metrics(stack, tiny_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    from services.trainer.model_setup import load_model
    from services.trainer.probe import compute_probe

    sampler, _ = stack
    run_dir = tmp_path / "trainer"
    async with RecordingClient(sampler.url, api_token=TOKEN) as client:
        await train(_settings(tiny_model_dir, sampler, run_dir, max_steps=2, eval_at_start=False,
                              eval_at_end=False), client)
        steps = _records(run_dir, "step")
        assert [body["version"] for body in client.published] == [1, 2]
        for step, body in enumerate(client.published):
            first = client.batches[step].samples[0]
            ids = [int(t) for t in [*first.prompt_token_ids, *first.completion_token_ids]][:64]
            probe = body["probe"]
            assert probe["token_ids"] == ids and probe["dtype"] == "float32"
            # Computed under exactly the weights published as this version.
            assert body["checkpoint_path"] == str(ckpt.version_path(run_dir / "published", step + 1))
            saved = compute_probe(load_model(body["checkpoint_path"], torch.float32, torch.device("cpu")), ids)
            assert probe["logprobs"][0] is None
            assert max(abs(a - b) for a, b in zip(probe["logprobs"][1:], saved["logprobs"][1:])) < 1e-5
            metrics = body["metrics"]
            record = steps[step]
            for key in ("behaviour_mismatch", "loss", "reward_mean", "grad_norm", "step", "checkpoint_s"):
                assert metrics[key] == record[key], key
            assert "batch_digest" not in metrics and "event" not in metrics and len(metrics) <= 64
        # The two probes differ: the weights moved.
        assert client.published[0]["probe"] != client.published[1]["probe"]

        # The sampler checked the probe against the inference server, and shows the metrics.
        served = await client.weights_version()
        assert served.version == 2
        for server in served.servers:
            assert server.probe is not None and server.probe.ok, server
            assert server.probe.max_abs_diff < 1e-3
        status = await client.status()
    trainer = status["trainer"]
    assert trainer is not None and trainer["version"] == 2
    assert trainer["behaviour_mismatch"] == steps[1]["behaviour_mismatch"]
    assert trainer["loss"] == steps[1]["loss"]


@pytest.mark.timeout(180)
async def test_wrong_behaviour_logprobs_stop_the_run_after_patience(stack, tiny_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    from services.trainer.mismatch import BehaviourMismatchError

    sampler, _ = stack
    run_dir = tmp_path / "trainer"
    async with RecordingClient(sampler.url, api_token=TOKEN, shift=-1.0) as client:
        with pytest.raises(BehaviourMismatchError) as info:
            await train(_settings(tiny_model_dir, sampler, run_dir, max_steps=6, eval_at_start=False,
                                  eval_at_end=False, behaviour_mismatch_patience=2), client)
        served = await client.weights_version()
    error = info.value
    assert error.steps == [0, 1] and error.threshold == 0.2 and error.value > 0.9
    assert "max_behaviour_mismatch=0" in str(error) and "2 consecutive steps" in str(error)
    # Nothing lost: step 1 is published, its metrics logged, and a full checkpoint written on
    # the way out although checkpoint_every (10) was not due.
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [1]
    assert served.version == 2
    assert [r["step"] for r in _records(run_dir, "step")] == [0, 1]
    warnings = _records(run_dir, "behaviour_mismatch")
    assert [(w["step"], w["consecutive"], w["stopping"]) for w in warnings] == [(0, 1, False), (1, 2, True)]
    assert not (run_dir / "trainer_summary.json").exists()

    # The same corruption with the guard off trains to the end.
    async with RecordingClient(sampler.url, api_token=TOKEN, shift=-1.0) as client:
        summary = await train(_settings(tiny_model_dir, sampler, run_dir, max_steps=4, eval_at_start=False,
                                        eval_at_end=False, max_behaviour_mismatch=0), client)
    assert summary["final_version"] == 4
    assert len(_records(run_dir, "behaviour_mismatch")) == 2


async def test_a_step_without_signal_publishes_the_same_weights_again(stack, tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    """Batch 1 carries no advantage: step 1 leaves the weights as they were, writes nothing, and
    version 2 is version 1's directory announced again (the servers reload it and pass the probe)."""
    from safetensors.torch import load_file

    sampler, _ = stack
    run_dir = tmp_path / "trainer"
    async with RecordingClient(sampler.url, api_token=TOKEN, no_signal_steps=(1,)) as client:
        summary = await train(_settings(tiny_model_dir, sampler, run_dir, max_steps=3, eval_at_start=False,
                                        eval_at_end=False, keep_published=3), client)
        served = await client.weights_version()
    steps = _records(run_dir, "step")
    assert [r["skipped_no_signal"] for r in steps] == [0, 1, 0]
    assert [r["published_bytes"] > 0 for r in steps] == [True, False, True]
    assert summary["skipped_steps_no_signal"] == 1 and summary["skipped_steps_non_finite"] == 0
    paths = [body["checkpoint_path"] for body in client.published]
    assert [body["version"] for body in client.published] == [1, 2, 3]
    assert paths[1] == paths[0] != paths[2]
    assert [v for v, _ in ckpt.list_published(run_dir / "published")] == [1, 3]
    one, three = load_file(Path(paths[0]) / "model.safetensors"), load_file(Path(paths[2]) / "model.safetensors")
    assert any(not torch.equal(one[n], three[n]) for n in one)  # step 2 had signal and moved them
    assert served.version == 3 and all(server.probe.ok for server in served.servers)
