"""`tandem demo`: the whole stack on one machine, as separate processes, on the toy task.

`run_demo(settings)`:

1. Prepares a fresh `run_dir` (refusing a non-empty directory it did not create) and
   writes a new model there with `init_model` (or uses `--model`).
2. Starts, each as its own `tandem <command>` process logging to `run_dir/logs/<name>.log`,
   the sampler (which starts the embedded Redis under `run_dir/redis`), the CPU inference
   server and the trainer, the last two forked after torch loaded once (forking.py). Ports
   are free unless given. The batch shape is derived once here, so the trainer's
   `per_device_batch_size * grad_accum_steps` always equals the sampler's
   `prompts_per_step * num_generations`. One token closes the run (every route of the
   sampler and the inference server but /health): TANDEM_API_TOKEN when set, else a random
   one; it travels in the children's environment, not on command lines.
   With `report_to`, the sampler and the trainer both get it, with one run name and one
   TensorBoard directory (`run_dir/tensorboard` unless given; docs/tracking.md).
3. Shows progress from `run_dir/trainer_metrics.jsonl` (a live bar on a terminal, plain
   lines otherwise) and prints the dashboard URL, the sampler's `GET /`, with the token (the
   page keeps it in a cookie).
4. When the trainer exits 0: reads the served weight version from the inference server's
   `/weight_info`, stops the sampler and the inference server (SIGTERM to their pids),
   makes sure the embedded redis-server is gone (pid from `run_dir/redis/server.json`),
   and writes `run_dir/summary.json`.

Failure modes: a child that exits early raises `ChildDied` with its log tail; a child
that does not become healthy within `startup_timeout`, or training that exceeds
`timeout`, raises `TimeoutError` naming what was awaited. Whatever happens, including
KeyboardInterrupt or `Interrupted` (SIGTERM, raised by the entrypoint's handler),
every child is stopped by its pid before `run_demo` returns or raises.

`run_dir/processes.json` lists every child's pid as soon as it starts (and the redis
pid once known), so an outside observer can verify that none is left behind.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import httpx

from services.demo.config import DemoSettings
from services.demo.display import Display, MetricsTail
from services.demo.forking import ForkedChild, limit_threads, preload
from services.demo.processes import Child, ChildDied, free_port, pid_alive, stop_pid, wait_healthy
from services.procs import local_url
from shared.token_guard import bearer_headers, dashboard_url

MARKER = ".tandem-demo"
SERVED_MODEL_NAME = "demo"
FAILED_STOP_TIMEOUT = 5.0
# `--trainer trl` runs the example users start from (an editable install: the checkout's).
TRL_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"


class DemoError(RuntimeError):
    """A problem the user can fix (the message says how)."""


class Interrupted(BaseException):
    """Raised in the main thread by a SIGINT/SIGTERM handler; BaseException so that no
    `except Exception` in between swallows it."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def prepare_run_dir(run_dir: Path) -> None:
    """Start from an empty run_dir: old checkpoints would make the trainer resume, and an
    old Redis would hand the sampler old batches."""
    if run_dir.exists():
        if not run_dir.is_dir():
            raise DemoError(f"run_dir {run_dir} exists and is not a directory; choose another --run-dir")
        if any(run_dir.iterdir()) and not (run_dir / MARKER).exists():
            raise DemoError(
                f"run_dir {run_dir} is not empty and was not created by `tandem demo`; the demo "
                "replaces its run_dir, so choose another --run-dir (or remove that directory)"
            )
        # A demo killed with -9 leaves its sampler's redis-server running on this directory.
        info = run_dir / "redis" / "server.json"
        if info.exists():
            try:
                stop_pid(int(json.loads(info.read_text())["pid"]), 10.0, expect="redis-server")
            except (ValueError, KeyError, OSError):
                pass
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / MARKER).write_text("created by `tandem demo`; the next demo run replaces this directory\n")


def _child_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    # The demo's flags are the children's only configuration: a TANDEM_* variable meant for
    # the demo (TANDEM_PORT, TANDEM_SEED...) must not leak into a service's settings.
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("TANDEM_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.update(extra or {})
    return env


def _tandem(command: str, **flags: Any) -> list[str]:
    argv = [sys.executable, "-m", "services.cli", command]
    for key, value in flags.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            argv += [flag, str(value)]
    return argv


class Demo:
    def __init__(self, settings: DemoSettings, out: TextIO | None = None):
        self.s = settings
        self.out = out or sys.stdout
        self.run_dir = Path(settings.run_dir).resolve()
        self.children: dict[str, Child] = {}
        self.redis_pid: int | None = None
        self.token: str | None = None  # the run's, once run() has chosen it
        self.hurry = False  # a second signal during shutdown: SIGKILL instead of waiting
        self.inference_port = settings.inference_port or free_port()
        self.sampler_port = settings.port or free_port()
        while self.sampler_port == self.inference_port:
            self.sampler_port = free_port()
        self.inference_url = local_url(settings.host, self.inference_port)
        self.sampler_url = local_url(settings.host, self.sampler_port)
        # Where the trainer writes trainer_metrics.jsonl (the same records from both trainers) and
        # its summary; the TRL example's summary.json must not collide with the demo's own.
        self.trainer_dir = self.run_dir if settings.trainer == "native" else self.run_dir / "trl"
        self.trainer_summary = "trainer_summary.json" if settings.trainer == "native" else "summary.json"

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    # -- processes ----------------------------------------------------------------------

    def _record_processes(self) -> None:
        info = {name: {"pid": c.pid, "log": str(c.log_path)} for name, c in self.children.items()}
        if self.redis_pid is not None:
            info["redis-server"] = {"pid": self.redis_pid, "log": str(self.run_dir / "redis" / "redis.log")}
        tmp = self.run_dir / "processes.json.tmp"
        tmp.write_text(json.dumps({"demo": os.getpid(), "children": info}, indent=2))
        os.replace(tmp, self.run_dir / "processes.json")

    def _start(self, name: str, argv: list[str], env: dict[str, str], forked: bool = False) -> Child:
        log = self.run_dir / "logs" / f"{name}.log"
        child = ForkedChild(name, argv, log, env) if forked else Child(name, argv, log, env)
        self.children[name] = child
        self._record_processes()
        return child

    def _tracking_flags(self) -> dict[str, Any]:
        """`report_to` and its knobs for the sampler and either trainer, resolved here so that
        both land in one W&B group and one TensorBoard tree whatever their run directories."""
        s = self.s
        if not s.report_to:
            return {}
        return {"report_to": ",".join(s.report_to), "run_name": s.tracking_name(),
                "wandb_project": s.wandb_project, "tensorboard_dir": self.run_dir / "tensorboard"
                if s.tensorboard_dir is None else Path(s.tensorboard_dir).resolve()}

    def _trainer_argv(self, model_dir: Path) -> list[str]:
        """The same run for either trainer: batch shape, steps, learning rate, loss, evals, seed
        and tracking."""
        s = self.s
        if s.trainer == "native":
            return _tandem(
                "trainer", model=model_dir, sampler_url=self.sampler_url, run_dir=self.run_dir,
                per_device_batch_size=s.per_device_batch_size, grad_accum_steps=s.grad_accum_steps,
                max_steps=s.steps, learning_rate=s.learning_rate, loss=s.loss, eval_every=s.eval_every,
                eval_examples=s.eval_examples, seed=s.seed, progress=False, log_level=s.log_level,
                lora_rank=s.lora_rank or None, beta=s.beta or None,
                lora_target_modules=",".join(s.lora_target_modules) if s.lora_rank else None, **self._tracking_flags(),
                **{k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in s.trainer_args.items()})
        flags = {"sampler_url": self.sampler_url, "model": model_dir, "max_steps": s.steps,
                 "output_dir": self.trainer_dir, "per_device_batch_size": s.per_device_batch_size,
                 "learning_rate": s.learning_rate, "loss": s.loss, "eval_every": s.eval_every,
                 "eval_examples": s.eval_examples, "seed": s.seed, "torch_threads": s.torch_threads,
                 "lora_rank": s.lora_rank,
                 "lora_target_modules": ",".join(s.lora_target_modules) if s.lora_rank else None,
                 **self._tracking_flags()}
        return [sys.executable, str(TRL_EXAMPLE)] + [
            arg for key, value in flags.items() if value is not None
            for arg in ("--" + key.replace("_", "-"), str(value))]

    def _check_children(self) -> None:
        for child in self.children.values():
            if child.returncode is not None and (child.name != "trainer" or child.returncode != 0):
                raise ChildDied(child)

    def _read_redis_pid(self) -> None:
        try:
            self.redis_pid = int(json.loads((self.run_dir / "redis" / "server.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return
        self._record_processes()

    def shutdown(self, failed: bool = False) -> dict[str, int | None]:
        """Stop every child by pid: trainer first (it drives the others), then sampler and
        inference together; then the sampler's redis-server if it outlived the sampler.
        After a failure the survivors get at most FAILED_STOP_TIMEOUT seconds: a sampler
        whose inference server died spends its whole graceful-shutdown budget retrying it."""
        def on_signal(signum: int, frame: Any) -> None:
            self.hurry = True

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, on_signal)
        if self.redis_pid is None:
            self._read_redis_pid()
        codes: dict[str, int | None] = {}
        for group in (["trainer"], ["sampler", "inference"]):
            children = [self.children[n] for n in group if n in self.children]
            for child in children:
                child.terminate()
            grace = min(self.s.stop_timeout, FAILED_STOP_TIMEOUT) if failed else self.s.stop_timeout
            deadline = time.monotonic() + grace
            for child in children:
                while child.returncode is None and time.monotonic() < deadline and not self.hurry:
                    time.sleep(0.05)
                codes[child.name] = child.wait_stopped(0)
        if self.redis_pid is not None and pid_alive(self.redis_pid):
            # The sampler stops the redis-server it started; if it was killed, nobody did.
            stop_pid(self.redis_pid, 0 if self.hurry else 10.0, expect="redis-server")
        return codes

    def _start_torch_children(self, model_dir: Path, threads: int, token: str) -> tuple[Child, Child]:
        """The inference server and the trainer: forked from this process once it imported torch
        (forking.py) where it can, fresh interpreters otherwise."""
        s = self.s
        # While the sampler starts on the other core: torch and transformers, once for both.
        fork_inference, fork_trainer = s.preload and s.backend == "cpu", s.preload and s.trainer == "native"
        if (fork_inference or fork_trainer) and not preload(model_dir, threads):
            self.say("note: a thread started as torch loaded (torch_threads > 1?): children start afresh")
            fork_inference = fork_trainer = False
        inference = self._start("inference", _tandem(
            "inference", model=model_dir, host=s.host, port=self.inference_port,
            served_model_name=SERVED_MODEL_NAME, seed=s.seed, run_dir=self.run_dir, log_level=s.log_level,
            backend=s.backend, torch_threads=threads if s.backend == "cpu" else None,
            # A LoRA run's versions are adapters: the server must load them at run time.
            enable_lora=True if s.lora_rank else None, max_lora_rank=max(16, s.lora_rank) if s.lora_rank else None,
        ), _child_env(threads, {"TANDEM_API_TOKEN": token}), forked=fork_inference)
        trainer = self._start("trainer", self._trainer_argv(model_dir),
                              _child_env(threads, {"TANDEM_API_TOKEN": token}), forked=fork_trainer)
        return inference, trainer

    # -- the run ------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        s = self.s
        started = time.monotonic()
        prepare_run_dir(self.run_dir)
        self.say(f"tandem demo: run_dir {self.run_dir} (logs in {self.run_dir / 'logs'})")
        if s.model and not (Path(s.model) / "config.json").is_file():
            raise DemoError(f"--model {s.model} is not a Hugging Face model directory (no config.json)")
        # The run's token: the user's (TANDEM_API_TOKEN) or a fresh one. Every child gets it in
        # its environment, never on a command line, and every server it starts is closed with it.
        token = s.api_token or secrets.token_urlsafe(16)
        self.token = token
        threads = s.torch_threads
        if s.preload:
            limit_threads(threads)
        try:
            sampler = self._start("sampler", _tandem(
                "sampler", host=s.host, port=self.sampler_port, run_dir=self.run_dir,
                inference_urls=self.inference_url, env=s.env, model_name=SERVED_MODEL_NAME,
                env_args=json.dumps(s.env_args) if s.env_args else None,
                prompts_per_step=s.prompts_per_step, num_generations=s.num_generations,
                max_staleness=s.max_staleness, on_policy=s.on_policy, temperature=s.temperature,
                max_tokens=s.max_tokens, seed=s.seed, eval_examples=s.eval_examples, log_level=s.log_level,
                **self._tracking_flags(),
            ), _child_env(threads, {"TANDEM_API_TOKEN": token}))
            # The sampler needs no model: it starts while the model is written.
            if s.model:
                model_dir = Path(s.model).resolve()
            else:
                from services.inference.init_model import init_model

                model_dir = init_model(self.run_dir / "model", preset=s.preset, seed=s.seed)
                self.say(f"fresh {s.preset} model (seed {s.seed}) in {model_dir}")
            inference, trainer = self._start_torch_children(model_dir, threads, token)
            # The trainer's client retries the sampler's /status (for 120 s) until it answers.
            self.say(f"started inference (pid {inference.pid}) on {self.inference_url}, sampler "
                     f"(pid {sampler.pid}) on {self.sampler_url}, trainer (pid {trainer.pid})")
            wait_healthy(f"{self.inference_url}/health", inference,
                         s.startup_timeout if s.backend == "cpu" else max(s.startup_timeout, 600.0), self._check_children)
            wait_healthy(f"{self.sampler_url}/health", sampler, s.startup_timeout, self._check_children)
            self._read_redis_pid()
            self.say(f"training: {s.steps} steps of {s.prompts_per_step} prompts x "
                     f"{s.num_generations} generations, max_staleness {s.max_staleness}"
                     f"{' (on-policy)' if s.max_staleness == 0 else ''}, inference: {s.backend}")
            self.say(f"dashboard: {dashboard_url(self.sampler_url, token)}")
            startup_seconds = time.monotonic() - started

            metrics = MetricsTail(self.trainer_dir / "trainer_metrics.jsonl")
            display = Display(s.steps, self.out, s.progress)
            deadline = time.monotonic() + s.timeout
            try:
                while trainer.returncode is None:
                    self._check_children()
                    for record in metrics.poll():
                        display.update(record)
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"the trainer did not finish {s.steps} steps within --timeout {s.timeout:.0f}s "
                            f"({len(metrics.steps)} done); see {trainer.log_path}"
                        )
                    time.sleep(0.2)
                for record in metrics.poll():
                    display.update(record)
            finally:
                display.close()
            self._check_children()  # the trainer exited: non-zero is a failure

            served = self._get_json(f"{self.inference_url}/weight_info")
            status = self._get_json(f"{self.sampler_url}/status")
            train_done = time.monotonic()
        except BaseException as exc:
            self.shutdown(failed=not isinstance(exc, (KeyboardInterrupt, Interrupted)))
            raise
        codes = self.shutdown()
        leftovers = {n: c.pid for n, c in self.children.items() if pid_alive(c.pid)}
        if self.redis_pid is not None and pid_alive(self.redis_pid):
            leftovers["redis-server"] = self.redis_pid
        summary = self._summary(metrics, served, status, codes, leftovers,
                                wall=time.monotonic() - started, until_trained=train_done - started,
                                startup=startup_seconds)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
        self._print_summary(summary)
        return summary

    def _get_json(self, url: str) -> dict[str, Any] | None:
        try:
            response = httpx.get(url, timeout=10, headers=bearer_headers(self.token))
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def _summary(self, metrics: MetricsTail, served: dict | None, status: dict | None,
                 codes: dict[str, int | None], leftovers: dict[str, int], *, wall: float,
                 until_trained: float, startup: float) -> dict[str, Any]:
        s = self.s
        try:
            trainer = json.loads((self.trainer_dir / self.trainer_summary).read_text())
        except (OSError, ValueError) as exc:
            raise DemoError(f"the trainer exited 0 but left no readable {self.trainer_summary}: {exc}") from None
        label = (served or {}).get("weight_version")
        return {
            "trainer": s.trainer,
            "steps": trainer.get("steps"),
            "wall_seconds": round(wall, 2),
            "eval_reward_before": trainer.get("eval_reward_before"),
            "eval_reward_after": trainer.get("eval_reward_after"),
            "staleness_mean": trainer.get("staleness_mean"),
            "staleness_max": max((int(r.get("staleness_max", 0)) for r in metrics.steps), default=0),
            "trainer_wait_fraction": trainer.get("trainer_wait_fraction"),
            "max_staleness": s.max_staleness,
            "on_policy": s.max_staleness == 0,
            "seed": s.seed,
            "startup_seconds": round(startup, 2),
            "seconds_until_trained": round(until_trained, 2),
            "trainer_seconds": trainer.get("wall_seconds"),
            "reward_mean_first": trainer.get("reward_mean_first"),
            "reward_mean_last": trainer.get("reward_mean_last"),
            # Steps that left the weights as they were: no advantage in the batch / non-finite loss.
            "skipped_steps_no_signal": trainer.get("skipped_steps_no_signal"),
            "skipped_steps_non_finite": trainer.get("skipped_steps_non_finite"),
            "evals": [{"label": e.get("label"), "version": e.get("version"), "reward": e.get("reward")}
                      for e in metrics.evals],
            "final_version": trainer.get("final_version"),
            "inference_weight_version": label,
            "sampler_published_version": ((status or {}).get("versions") or {}).get("published"),
            "batch_shape": {"prompts_per_step": s.prompts_per_step, "num_generations": s.num_generations,
                            "per_device_batch_size": s.per_device_batch_size,
                            "grad_accum_steps": s.grad_accum_steps},
            "dashboard_url": f"{self.sampler_url}/",
            "run_dir": str(self.run_dir),
            "pids": {n: c.pid for n, c in self.children.items()} | (
                {"redis-server": self.redis_pid} if self.redis_pid is not None else {}),
            "exit_codes": codes,
            "processes_left": leftovers,
            "settings": s.model_dump(mode="json"),
        }

    def _print_summary(self, summary: dict[str, Any]) -> None:
        def num(key: str, spec: str = ".3f") -> str:
            value = summary.get(key)
            return format(value, spec) if isinstance(value, (int, float)) else "n/a"

        self.say("")
        self.say("summary")
        self.say(f"  steps                  {summary['steps']}  ({summary['trainer']} trainer, max_staleness "
                 f"{summary['max_staleness']}"
                 f"{', on-policy' if summary['on_policy'] else ''}, seed {summary['seed']})")
        self.say(f"  eval reward            {num('eval_reward_before', '.2f')} -> {num('eval_reward_after', '.2f')}"
                 "  (greedy, held-out prompts)")
        self.say(f"  wall time              {num('wall_seconds', '.1f')} s  (start-up {num('startup_seconds', '.1f')} s)")
        self.say(f"  staleness mean         {num('staleness_mean', '.2f')}  (max {summary['staleness_max']})")
        self.say(f"  trainer waiting        {100 * (summary.get('trainer_wait_fraction') or 0):.0f}% of its time")
        if summary.get("skipped_steps_no_signal") is not None:
            self.say(f"  steps without signal   {summary['skipped_steps_no_signal']}  (weights left as they were)")
        self.say(f"  served weights         version {summary['inference_weight_version']}")
        if summary["processes_left"]:
            self.say(f"  WARNING: processes still running: {summary['processes_left']}")
        self.say(f"  written to             {self.run_dir / 'summary.json'}")


def run_demo(settings: DemoSettings, out: TextIO | None = None) -> dict[str, Any]:
    """Run the demo; returns the summary (also in run_dir/summary.json)."""
    return Demo(settings, out).run()
