"""Full checkpoints of one run (`Checkpoints`): float32 weights, gathered on rank 0, and the
optimizer state, written to run_dir/checkpoints/step-N for a resume (services/trainer/checkpoint.py
has the files' format, commit and pruning). Every rank calls `write`: the gather and the
optimizer's save are collectives under fsdp."""

from __future__ import annotations

import shutil
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.trainer import checkpoint as ckpt
from services.trainer.config import TrainerSettings
from services.trainer.run_state import RunState
from services.trainer.step_record import learning_rate
from services.trainer.world import World


class Checkpoints:
    def __init__(self, settings: TrainerSettings, world: World, *, sharding: Any, model: Any, optimizer: Any,
                 lora: Any, drill: Any, state: RunState, public_settings: dict[str, Any],
                 in_thread: Callable[..., Awaitable[Any]]):
        self.settings, self.world, self.sharding = settings, world, sharding
        self.model, self.optimizer, self.lora = model, optimizer, lora
        self.drill, self.state, self.public_settings = drill, state, public_settings
        self.in_thread = in_thread  # the trainer's one torch thread

    def gather(self) -> dict[str, Any] | None:
        """COLLECTIVE: what a checkpoint holds, on rank 0: the full float32 weights, or a LoRA
        run's adapter alone (the frozen base is not gathered)."""
        return self.sharding.full_state_dict(self.model, trainable_only=self.lora is not None)

    async def write(self, step: int, lr: float, record: dict[str, Any] | None = None) -> None:
        """Full checkpoint `step` (every rank calls it): float32 weights, gathered here, and
        optimizer state, for a resume; rank 0 commits and prunes."""
        s, state, world = self.settings, self.state, self.world
        t0 = time.monotonic()
        full = await self.in_thread(self.gather)
        root, what = ckpt.checkpoint_dir(s.run_dir), f"checkpoint step-{step}"
        tmp = root / f".tmp-step-{step}"
        needed = ckpt.checkpoint_bytes(full, optimizer=s.save_optimizer) if world.is_main else 0
        try:
            if world.is_main:
                await self.drill.point("checkpoint", step)
                # Refused before anything is written: a full disk costs no committed checkpoint.
                ckpt.ensure_space(root, needed, what)
                tmp = await self.in_thread(ckpt.begin_checkpoint, s.run_dir, step)
            await self.in_thread(world.barrier)
            with ckpt.disk_errors(root, needed, what):
                if s.save_optimizer:
                    await self.in_thread(self.sharding.save_optimizer, self.model, self.optimizer, tmp)
                await self.in_thread(world.barrier)
                if world.is_main:
                    # The step's metrics ride along: a kill before its metrics line is written
                    # loses no record (services/trainer/metrics_history.py, `prepare`).
                    lora = self.lora
                    state.last_checkpoint = await self.in_thread(
                        ckpt.commit_checkpoint, s.run_dir, step, tmp, model=self.model, state_dict=full,
                        model_dir=s.model if lora is None else None,
                        write_weights=lora.checkpoint_writer(full) if lora is not None else None,
                        state={"lr": lr, "world_size": world.world_size, "sharding": self.sharding.kind,
                               "settings": self.public_settings, "record": record,
                               **(lora.record() if lora is not None else {})},
                    )
        except BaseException:
            if world.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        state.checkpoint_step = step
        if world.is_main:
            await self.drill.point("checkpointed", step)
            ckpt.prune_checkpoints(s.run_dir, s.keep_checkpoints)
            if record is not None:
                record["checkpoint_bytes"] = ckpt.dir_bytes(state.last_checkpoint)
                record["checkpoint_s"] = time.monotonic() - t0

    async def final(self) -> None:
        """A full checkpoint of the last trained step, unless it has one (a run stopping early)."""
        state = self.state
        last = state.last_step
        if last is not None and state.checkpoint_step != last:
            await self.write(last, learning_rate(self.settings, last))
