"""Against the peer: `tandem demo` vs plain TRL `GRPOTrainer` on the same toy run.

Per seed (0, 1 by default), one after the other in one invocation:

* **tandem**: `tandem demo --seed S` with its defaults (the whole stack: Redis, the CPU
  inference server, the sampler, the native trainer), as `bench convergence` runs it.
* **trl**: plain TRL, as a user would write it: `trl.GRPOTrainer` generating with transformers
  in-process (`use_vllm=False`), in a subprocess of its own (this module's `--trl-worker`), on
  the demo's model (`init_model(preset, seed)`, the same weights), the demo's train prompts in
  the order its sampler hands them out, the toy environment's own reward function, and a
  `GRPOConfig` mapped from the demo's settings (`trl_config_values`). Greedy evals run in the
  training loop on the demo's schedule (before, every `eval_every` steps, after; a callback,
  in-process). The final model's reported eval is the demo's own: the saved model served by
  `tandem inference`, evaluated by `tandem sampler`'s `POST /eval` (greedy, the environment's
  first `eval_examples` eval prompts), read with the trainer's `eval_reward`, exactly as the
  native trainer's "after" eval. It runs after the TRL process has exited, outside its time.

Time to finish the steps: from launching the process (`tandem demo` / the TRL worker) to the
moment the last optimizer step is done (tandem: its trainer's metrics record of the last version;
trl: a `TrainerCallback.on_step_end` stamp). Both include start-up (imports, writing the model)
and the evals each runs on the way. Steps/s: (steps - 1) / (time of the last step - time of the
first), the steady rate without start-up. Ratio: tandem / trl (target <= 1.0).

    .venv/bin/python -m bench peer                          # seeds 0 1, the demo's 150 steps
    .venv/bin/python -m bench peer --steps 3 --seeds 0      # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

# The bench side's helpers (bench._common, bench.bench_convergence) are imported where used: the
# TRL worker, timed from its launch, imports only what a plain TRL script would.
REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("tandem", "trl")
WORKER_TIMEOUT = 3600.0

# The demo settings plain TRL cannot take, and why (the results file lists them).
DIFFERENCES = [
    "Generation: TRL generates on-policy in-process with the current weights (transformers `generate`), "
    "then trains, one after the other; the demo samples on a separate CPU inference server with "
    "max_staleness 1 while the trainer trains (batches up to one version stale), and the native trainer "
    "corrects for that with truncated importance weights (tis_cap 2). In TRL with num_iterations 1 the "
    "ratio is exactly 1, so clipping (epsilon 0.2) never acts.",
    "Steps without signal: the native trainer leaves the weights (and AdamW's state) alone on a batch "
    "whose advantages are all 0; TRL takes the optimizer step anyway, and AdamW's momentum still moves "
    "the weights.",
    "Rows without advantage (a group all right or all wrong): the native trainer forwards them without an "
    "autograd graph and never backpropagates them, since without a KL term their gradient is exactly zero "
    "(the step and its metrics are the same); TRL backpropagates every row.",
    "Advantage epsilon: both normalise by the group's Bessel-corrected std; Tandem's sampler adds 1e-6, "
    "TRL adds 1e-4.",
    "Threads: the demo gives each child one torch thread (inference and training overlap on separate "
    "cores); the TRL process, which generates and trains in turn, uses torch's default thread count.",
    "Random streams: same seed, different samplers (the inference server's seeded sampling vs torch's "
    "generator in `generate`), so the sampled completions differ.",
    "Evals on the way: the demo's periodic greedy evals run on its inference server concurrently with "
    "training; TRL's run in-process in a callback on the same schedule, between steps. The final eval "
    "of both is the sampler's greedy `/eval` through the CPU inference server.",
]


# -- the TRL side (runs in its own process: `python -m bench.bench_peer --trl-worker ...`) ----------


def demo_settings(seed: int, steps: int | None):
    """The demo's settings for this seed, parsed as `tandem demo --seed S [--steps N]` parses them."""
    from services.demo.config import DemoSettings
    from shared.settings import load

    return load(DemoSettings, ["--seed", str(seed), *(["--steps", str(steps)] if steps else [])], "tandem demo")


def max_tokens_of(settings, env) -> int:
    """What the sampler samples per completion (services/sampler/rollouts/rollout.py, Rollouts.max_tokens)."""
    return int(settings.max_tokens or env.sampling.get("max_tokens") or 16)


def train_prompts(settings, env) -> list[Any]:
    """The demo's train prompts in the order its sampler hands them out: prompt slot j of step N is
    train[order[N * prompts_per_step + j]] (services/sampler/building/sources.py), order seeded with the seed."""
    from services.sampler.rollouts.seeds import DatasetOrder

    train = list(env.examples("train"))
    order = DatasetOrder(len(train), settings.seed)
    return [train[order[i]] for i in range(settings.steps * settings.prompts_per_step)]


def trl_config_values(settings, env) -> dict[str, Any]:
    """GRPOConfig fields from the demo's settings (and the native trainer's defaults it runs with)."""
    return {
        "max_steps": settings.steps, "learning_rate": settings.learning_rate, "lr_scheduler_type": "constant",
        "warmup_steps": 0, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
        "max_grad_norm": 1.0, "optim": "adamw_torch",
        # One optimizer step sees one demo batch: prompts_per_step x num_generations completions.
        "per_device_train_batch_size": settings.per_device_batch_size,
        "gradient_accumulation_steps": settings.grad_accum_steps,
        "num_generations": settings.num_generations, "num_iterations": 1,
        "max_completion_length": max_tokens_of(settings, env), "temperature": settings.temperature,
        "top_p": 1.0, "top_k": 0,
        "loss_type": settings.loss, "beta": 0.0, "epsilon": 0.2, "scale_rewards": "group",
        "mask_truncated_completions": False, "importance_sampling_level": "token",
        # The prompts are already in the sampler's order (train_prompts).
        "shuffle_dataset": False, "seed": settings.seed,
        "use_vllm": False, "use_cpu": True, "bf16": False,
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
    }


def score(env, examples: list[Any], texts: list[str]) -> list[float]:
    """The environment's own reward (`Environment.score`, the weighted sum the sampler uses)."""
    from services.sampler.rollouts.envs.base import Completion

    async def all_scores() -> list[float]:
        scored = await asyncio.gather(*(env.score(ex, Completion(text=t, prompt_token_ids=[], token_ids=[],
                                                                 logprobs=[], finish_reason="length"))
                                        for ex, t in zip(examples, texts, strict=True)))
        return [total for total, _ in scored]

    return asyncio.run(all_scores())


def greedy_eval(model, tokenizer, env, examples: list[Any], max_tokens: int) -> float:
    """In-process greedy eval (the TRL run's evals on the way; its final number is the served eval)."""
    import torch

    was_training = model.training
    model.eval()
    enc = tokenizer([env.format_prompt(ex) for ex in examples], return_tensors="pt", padding=True,
                    padding_side="left", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    if was_training:
        model.train()
    rewards = score(env, examples, texts)
    return sum(rewards) / len(rewards)


def trl_worker(seed: int, steps: int | None, out: Path) -> int:
    """Plain TRL on the demo's run; writes out/summary.json and the final model to out/final."""
    started = time.time()
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from services.inference.init_model import init_model
    from services.sampler.rollouts.envs import load_environment

    s = demo_settings(seed, steps)
    env = load_environment(s.env, **s.env_args)
    max_tokens = max_tokens_of(s, env)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(s.model).resolve() if s.model else init_model(out / "model", preset=s.preset, seed=s.seed)
    prompts = train_prompts(s, env)
    by_id = {ex.prompt_id: ex for ex in prompts}
    dataset = Dataset.from_dict({"prompt": [env.format_prompt(ex) for ex in prompts],
                                 "prompt_id": [ex.prompt_id for ex in prompts]})
    eval_examples = list(env.examples("eval"))[:s.eval_examples]

    seen: list[str] = []  # each group's prompt, in the order TRL trains on them

    def correct(prompts: list[str], completions: list[str], prompt_id: list[str], **_: Any) -> list[float]:
        seen.extend(prompt_id[::s.num_generations])
        return score(env, [by_id[i] for i in prompt_id], completions)

    values = trl_config_values(s, env)
    config = GRPOConfig(output_dir=str(out / "trl"), **values)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    step_times: list[float] = []
    evals: list[dict[str, Any]] = []

    class Timing(TrainerCallback):
        """Stamps each optimizer step; the demo's greedy evals on its schedule, between steps."""

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step_times.append(time.time())
            if s.eval_every and state.global_step % s.eval_every == 0 and state.global_step < s.steps:
                evals.append({"label": "periodic", "version": state.global_step,
                              "reward": greedy_eval(model, tokenizer, env, eval_examples, max_tokens)})

    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=correct, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timing()])
    evals.append({"label": "before", "version": 0,
                  "reward": greedy_eval(trainer.model, tokenizer, env, eval_examples, max_tokens)})
    train_started = time.time()
    trainer.train()
    evals.append({"label": "after", "version": trainer.state.global_step,
                  "reward": greedy_eval(trainer.model, tokenizer, env, eval_examples, max_tokens)})
    trainer.save_model(str(out / "final"))
    tokenizer.save_pretrained(str(out / "final"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    summary = {
        "trl_version": trl.__version__, "torch_threads": torch.get_num_threads(), "process_started": started,
        "train_started": train_started, "step_times": step_times, "steps": trainer.state.global_step,
        "evals": evals, "reward_mean_first": rewards[0] if rewards else None,
        "reward_mean_last": rewards[-1] if rewards else None, "model": str(model_dir),
        "grpo_config": {k: getattr(config, k) for k in values},
        "generation_batch_size": config.generation_batch_size, "steps_per_generation": config.steps_per_generation,
        "train_prompts": len(prompts), "eval_examples": len(eval_examples),
        # The groups TRL trained on are the demo's, in the demo sampler's order.
        "prompt_order_matches_demo": seen == [ex.prompt_id for ex in prompts[:len(seen)]] and len(seen) == len(prompts),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0


# -- the bench side ---------------------------------------------------------------------------------


def served_eval(model_dir: Path, settings, work: Path) -> float | None:
    """The demo's own eval of a model directory: `tandem inference` serving it, `tandem sampler`'s
    greedy `POST /eval` over the environment's eval prompts, read with the native trainer's
    `eval_reward`."""
    from bench._common import RUN_TOKEN, sampler_process, token_env
    from services.procs import free_port
    from services.trainer.metrics import eval_reward
    from shared.client import SamplerClient
    from tests.support.servers import ServiceProcess

    port = free_port()
    inference = ServiceProcess(
        [sys.executable, "-m", "services.cli", "inference", "--model", str(model_dir), "--port", str(port),
         "--served-model-name", "demo", "--seed", str(settings.seed), "--torch-threads", "1"],
        name="inference", log_path=work / "inference.log", ready_url=f"http://127.0.0.1:{port}/health",
        env={**token_env(), "OMP_NUM_THREADS": "1"})
    try:
        inference.wait_ready(180)
        sampler_flags: dict[str, Any] = {"max_tokens": settings.max_tokens} if settings.max_tokens else {}
        if settings.env_args:
            sampler_flags["env_args"] = json.dumps(settings.env_args)
        with sampler_process(work / "sampler", inference_urls=f"http://127.0.0.1:{port}", env=settings.env,
                             model_name="demo", seed=settings.seed, prompts_per_step=settings.prompts_per_step,
                             num_generations=settings.num_generations, temperature=settings.temperature,
                             eval_examples=settings.eval_examples, **sampler_flags) as sampler:

            async def ask() -> float | None:
                client = SamplerClient(sampler.url, api_token=RUN_TOKEN)  # type: ignore[attr-defined]
                try:
                    eval_id = await client.start_eval(num_examples=settings.eval_examples)
                    result = await client.wait_eval(eval_id, timeout=600)
                finally:
                    await client.aclose()
                return eval_reward(result.result) if result.status == "done" else None

            return asyncio.run(ask())
    finally:
        inference.terminate()


def step_rate(times: list[float]) -> float | None:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None


def run_tandem(seed: int, steps: int | None, run_dir: Path) -> dict[str, Any]:
    from bench.bench_convergence import run_seed

    launched = time.time()
    row = run_seed(seed, run_dir, **({"steps": steps} if steps else {}))
    out = {"seed": seed, "system": "tandem", "ok": row.get("eval_reward_after") is not None,
           "wall_seconds": row["wall_seconds"], "eval_reward_after": row.get("eval_reward_after"),
           "first_eval_version_at_target": row.get("first_eval_version_at_target"),
           "reward_mean_last": row.get("reward_mean_last"),
           "skipped_steps_no_signal": row.get("skipped_steps_no_signal"), "steps": row.get("steps")}
    if "error" in row:
        out["error"] = row["error"]
        return out
    times = []
    for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "step":
            times.append(record["time"])
    out.update(seconds_to_steps=round(times[-1] - launched, 2) if times else None,
               steps_per_s=round(step_rate(times), 3) if step_rate(times) else None)
    return out


def run_trl(seed: int, steps: int | None, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "bench.bench_peer", "--trl-worker", "--seed", str(seed), "--out", str(work),
            *(["--steps", str(steps)] if steps else [])]
    launched = time.time()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=WORKER_TIMEOUT)
    wall = time.time() - launched
    (work / "worker.log").write_text(done.stdout + done.stderr)
    out: dict[str, Any] = {"seed": seed, "system": "trl", "wall_seconds": round(wall, 1)}
    if done.returncode != 0:
        return {**out, "ok": False, "exit": done.returncode, "error": (done.stdout + done.stderr)[-2000:]}
    summary = json.loads((work / "summary.json").read_text())
    times = summary["step_times"]
    rewards = [e["reward"] for e in summary["evals"]]
    first = next((e["version"] for e in summary["evals"] if e["reward"] >= 0.95), None)
    settings = demo_settings(seed, steps)
    try:
        served = served_eval(work / "final", settings, work / "eval")
    except Exception as exc:  # noqa: BLE001 -- the timing still stands; say what failed
        served, out["eval_error"] = None, f"{type(exc).__name__}: {exc}"
    out.update(ok=served is not None, steps=summary["steps"], seconds_to_steps=round(times[-1] - launched, 2),
               steps_per_s=round(step_rate(times), 3) if step_rate(times) else None, eval_reward_after=served,
               eval_reward_after_in_process=rewards[-1] if rewards else None, first_eval_version_at_target=first,
               reward_mean_last=summary["reward_mean_last"], trl_version=summary["trl_version"],
               torch_threads=summary["torch_threads"], grpo_config=summary["grpo_config"],
               generation_batch_size=summary["generation_batch_size"],
               prompt_order_matches_demo=summary["prompt_order_matches_demo"])
    return out


def run(results_dir: Path, seeds: tuple[int, ...] = (0, 1), steps: int | None = None) -> dict[str, Any]:
    from bench._common import host, write_results

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tandem-peer-bench-") as tmp:
        for seed in seeds:
            for system in SYSTEMS:
                work = Path(tmp) / f"{system}-{seed}"
                row = run_tandem(seed, steps, work) if system == "tandem" else run_trl(seed, steps, work)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "grpo_config"}), flush=True)
    ratios = []
    for seed in seeds:
        t, p = ([r for r in rows if r["seed"] == seed and r["system"] == s] for s in SYSTEMS)
        a, b = t[0].get("seconds_to_steps"), p[0].get("seconds_to_steps")
        ratio = round(a / b, 3) if a and b else None
        t[0]["ratio_tandem_over_trl"] = p[0]["ratio_tandem_over_trl"] = ratio
        ratios.append(ratio)
    trl_row = next((r for r in rows if r["system"] == "trl" and "grpo_config" in r), {})
    settings = demo_settings(seeds[0], steps)

    def med(system: str, key: str) -> float | None:
        xs = [r[key] for r in rows if r["system"] == system and isinstance(r.get(key), (int, float))]
        return median(xs) if xs else None

    finite = [x for x in ratios if x is not None and math.isfinite(x)]
    result = {
        "command": "python -m bench peer" + (f" --steps {steps}" if steps else "") + " --seeds "
                   + " ".join(map(str, seeds)),
        "steps": settings.steps, "seeds": list(seeds), "target": "tandem seconds_to_steps / trl <= 1.0",
        "rows": rows,
        "medians": {s: {k: med(s, k) for k in ("seconds_to_steps", "steps_per_s", "wall_seconds", "eval_reward_after")}
                    for s in SYSTEMS},
        "ratio_median": median(finite) if finite else None,
        "target_met": bool(finite) and len(finite) == len(ratios) and max(finite) <= 1.0,
        "trl_version": trl_row.get("trl_version"), "grpo_config": trl_row.get("grpo_config"),
        "trl_torch_threads": trl_row.get("torch_threads"),
        "demo_settings": settings.model_dump(mode="json", include={
            "steps", "prompts_per_step", "num_generations", "temperature", "max_tokens", "learning_rate", "loss",
            "max_staleness", "eval_every", "eval_examples", "preset", "env", "torch_threads"}),
        "differences": DIFFERENCES, "host": host(),
    }
    write_results(results_dir, "peer", result, markdown(result))
    return result


def markdown(result: dict[str, Any]) -> str:
    def num(value: Any, spec: str = ".2f") -> str:
        return format(value, spec) if isinstance(value, (int, float)) else "n/a"

    d = result["demo_settings"]
    lines = [
        "# Against the peer: `tandem demo` vs plain TRL GRPOTrainer", "",
        f"`.venv/bin/python -m bench peer`: `{result['command']}`", "",
        f"Per seed, one after the other on this machine ({result['host']['cpus']} CPUs, load "
        f"{result['host']['loadavg_1m_at_end']} at the end): `tandem demo --seed S` with its defaults (native trainer, "
        f"{d['env']} task, {d['preset']} model, {result['steps']} steps of {d['prompts_per_step']} prompts x "
        f"{d['num_generations']} generations, max_staleness {d['max_staleness']}, lr {d['learning_rate']:g}, "
        f"{d['loss']} loss, greedy eval of {d['eval_examples']} prompts every {d['eval_every']} steps), then plain "
        f"TRL {result['trl_version']} `GRPOTrainer` generating with transformers in-process on the same model, "
        "prompts, reward and hyperparameters (GRPOConfig below). Target: tandem finishes the steps no slower "
        f"than TRL (ratio <= 1.0). Target met: **{'yes' if result['target_met'] else 'no'}**.", "",
        "Seconds to steps: from launching the process to the last optimizer step done (start-up and the evals on "
        "the way included). Steps/s: the steady rate, (steps - 1) / (last step - first step). Eval after: the "
        "final model's greedy eval by the sampler's `/eval` through the CPU inference server (the demo's own).", "",
        "| seed | system | ok | seconds to steps | steps/s | process wall s | eval after | first eval >= 0.95 at "
        "| ratio tandem/trl |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['seed']} | {r['system']} | {'yes' if r.get('ok') else 'NO'} | "
                     f"{num(r.get('seconds_to_steps'), '.1f')} | {num(r.get('steps_per_s'), '.3f')} | "
                     f"{num(r.get('wall_seconds'), '.1f')} | {num(r.get('eval_reward_after'))} | "
                     f"{r.get('first_eval_version_at_target')} | {num(r.get('ratio_tandem_over_trl'), '.3f')} |")
    lines += ["", "| system | median seconds to steps | median steps/s | median eval after |", "|---|---|---|---|"]
    for system, m in result["medians"].items():
        lines.append(f"| {system} | {num(m['seconds_to_steps'], '.1f')} | {num(m['steps_per_s'], '.3f')} | "
                     f"{num(m['eval_reward_after'])} |")
    lines += ["", f"Median ratio tandem/trl: {num(result['ratio_median'], '.3f')}", "",
              f"## GRPOConfig (TRL {result['trl_version']}, torch threads {result['trl_torch_threads']})", "",
              "```json", json.dumps(result["grpo_config"], indent=1, default=str), "```", "",
              "## Differences that remain", ""]
    lines += [f"* {d}" for d in result["differences"]]
    errors = [r for r in result["rows"] if r.get("error") or r.get("eval_error")]
    if errors:
        lines += ["", "## Errors", ""]
        lines += [f"* seed {r['seed']} {r['system']}: {(r.get('error') or r.get('eval_error'))[-500:]!r}"
                  for r in errors]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench peer", description="tandem demo vs plain TRL GRPOTrainer")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the demo's, 150 on toy)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = p.parse_args(argv)
    return {"seeds": tuple(args.seeds), "steps": args.steps}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="the plain-TRL side of bench peer, in its own process")
    p.add_argument("--trl-worker", action="store_true", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    return trl_worker(args.seed, args.steps, args.out)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
