"""Train with TRL's GRPOTrainer on batches from a running Tandem sampler (docs/trl.md).

    python examples/trl_grpo.py --sampler-url http://127.0.0.1:8100 --model runs/demo/model \
        --max-steps 60 --output-dir runs/trl
    accelerate launch --multi_gpu --num_processes 2 examples/trl_grpo.py ...   # two ranks

Without CUDA the two ranks run on the CPU over gloo (accelerate 1.15's `--cpu` with several
processes wants mpirun; `--multi_gpu` is its torchrun launcher, and this script asks for the CPU).

The batch shape, num_generations, temperature and completion length come from the sampler's
`GET /status`; the rest of the GRPOConfig mirrors the native trainer's defaults (constant
learning rate, per-sequence `grpo` loss, clip 0.2, importance weights truncated at 2 per
token). Writes `output-dir/summary.json`: eval_reward_before, eval_reward_after (the
sampler's greedy `/eval`), steps, wall_seconds, and the per-step batches and publications.
`--report-to wandb,tensorboard` reports TRL's metrics there (docs/tracking.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Run as a script from anywhere in the checkout: the repository root holds `services` and `shared`.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sampler-url", required=True, help="the Tandem sampler's base URL")
    p.add_argument("--model", required=True, help="HF model directory the inference servers started from")
    p.add_argument("--max-steps", type=int, required=True, help="optimizer steps (= sampler steps)")
    p.add_argument("--output-dir", required=True, help="TRL's output_dir; summary.json and published/ go here")
    p.add_argument("--api-token", default=os.environ.get("TANDEM_API_TOKEN"),
                   help="the run's token, which the sampler was started with; every route but /health "
                        "needs it (default: $TANDEM_API_TOKEN)")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--loss", choices=("grpo", "dapo", "dr_grpo"), default="grpo",
                   help="TRL's loss_type; these three mean what the native trainer's --loss means")
    p.add_argument("--per-device-batch-size", type=int, default=None,
                   help="micro-batch size; default: this rank's whole share of a batch (no accumulation)")
    p.add_argument("--eval-examples", type=int, default=None, help="default: the sampler's eval_examples")
    p.add_argument("--eval-every", type=int, default=0,
                   help="also evaluate every N optimizer steps, through TRL's eval loop (0: only before and after)")
    p.add_argument("--publish-dir", default=None, help="where versions go (default: OUTPUT_DIR/published)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train a LoRA adapter of this rank (TRL's peft_config); versions are published as adapters")
    p.add_argument("--lora-target-modules", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                   help="comma-separated layers that get the adapter (the demo passes its own: docs/lora.md)")
    p.add_argument("--report-to", default="none",
                   help="TRL's report_to: wandb and/or tensorboard (comma-separated), or none (docs/tracking.md)")
    p.add_argument("--run-name", default=None,
                   help="W&B group of this run (the W&B run is RUN_NAME-trainer); default: the output dir's name")
    p.add_argument("--wandb-project", default=None, help="W&B project (default: $WANDB_PROJECT, else tandem)")
    p.add_argument("--tensorboard-dir", default=None,
                   help="TensorBoard events go to TENSORBOARD_DIR/trainer (default: OUTPUT_DIR/tensorboard)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.max_steps < 1:
        p.error("--max-steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch
    from accelerate import PartialState
    from trl import GRPOConfig

    from services.trl_bridge.agreement import grpo_config_values
    from services.trl_bridge.sampler_link import SamplerLink
    from services.trl_bridge.tracking import grpo_reporting
    from services.trl_bridge.trainer import TandemGRPOTrainer

    # A backend that is not installed is refused before anything starts.
    reporting = grpo_reporting(args.report_to, run_name=args.run_name or Path(args.output_dir).resolve().name,
                               output_dir=args.output_dir, wandb_project=args.wandb_project,
                               tensorboard_dir=args.tensorboard_dir)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    started = time.monotonic()
    # cpu=True without CUDA: under a multi-process launcher that makes accelerate pick gloo. The
    # state is a singleton, so this first construction is what the GRPOConfig below gets too.
    world = PartialState(cpu=not torch.cuda.is_available()).num_processes
    link = SamplerLink(args.sampler_url, api_token=args.api_token)
    try:
        link.check_token()  # a missing or wrong token said plainly, before GET /status (guarded too)
        status = link.status()
    finally:
        link.close()
    share = status.get("config", {}).get("prompts_per_step", 1) * status.get("config", {}).get("num_generations", 1)
    per_device = args.per_device_batch_size or max(share // world, 1)
    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.max_steps, learning_rate=args.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        loss_type=args.loss, beta=0.0, epsilon=0.2,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
        logging_steps=1, save_strategy="no", seed=args.seed, **reporting,
        use_cpu=not torch.cuda.is_available(), bf16=False, disable_tqdm=True,
        **grpo_config_values(status, world, per_device),
        # Periodic evals are the sampler's /eval (TandemGRPOTrainer.evaluate); GRPOConfig still asks
        # for an eval batch that holds whole groups, which nothing reads.
        **({"eval_strategy": "steps", "eval_steps": args.eval_every,
            "per_device_eval_batch_size": status["config"]["num_generations"]} if args.eval_every else {}),
    )
    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig

        # By default the attention and MLP projections: what vLLM serves adapters on (docs/lora.md).
        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                 target_modules=args.lora_target_modules.split(","))
    trainer = TandemGRPOTrainer(args.model, args=config, sampler_url=args.sampler_url, api_token=args.api_token,
                                publish_dir=args.publish_dir, eval_examples=args.eval_examples,
                                peft_config=peft_config)
    try:
        before = trainer.evaluate(metric_key_prefix="eval_before")
        t_train = time.monotonic()
        trainer.train()
        train_seconds = time.monotonic() - t_train
        after = trainer.evaluate(metric_key_prefix="eval_after")
    finally:
        trainer.close()
    if trainer.accelerator.is_main_process:
        batches, pubs = trainer.tandem_batches, trainer.tandem_publications
        summary = {
            "steps": trainer.tandem_steps,
            "optimizer_steps": trainer.state.global_step,
            "wall_seconds": time.monotonic() - started,
            "train_seconds": train_seconds,
            "eval_reward_before": before.get("eval_before_reward"),
            "eval_reward_after": after.get("eval_after_reward"),
            # The native trainer's summary keys (services/trainer/trainer.py), for `tandem demo --trainer trl`.
            "staleness_mean": sum(b["staleness_mean"] for b in batches) / len(batches) if batches else None,
            "trainer_wait_fraction": sum(b["wait_s"] for b in batches) / train_seconds if train_seconds else None,
            "reward_mean_first": batches[0]["reward_mean"] if batches else None,
            "reward_mean_last": batches[-1]["reward_mean"] if batches else None,
            "skipped_steps_no_signal": trainer.skipped_steps_no_signal,
            "skipped_steps_non_finite": trainer.skipped_steps_non_finite,
            "final_version": pubs[-1]["version"] if pubs else 0,
            "world_size": world,
            "batches": trainer.tandem_batches,
            "publications": trainer.tandem_publications,
            "evals": [{"step": h.get("step"), "reward": h["eval_reward"]}
                      for h in trainer.state.log_history if "eval_reward" in h],
            "log_history": trainer.state.log_history,
        }
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        print(json.dumps({k: summary[k] for k in ("steps", "wall_seconds", "eval_reward_before",
                                                  "eval_reward_after", "final_version")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
