"""Where this trainer process stands in a torch.distributed job: rank, world size, device.

Under `torchrun` every rank runs the same trainer; the environment (RANK, WORLD_SIZE,
LOCAL_RANK) says which one this is. Without it the trainer is a single process, rank 0 of 1,
and no process group is created. With several ranks the process group is created here
(NCCL on CUDA, gloo on CPU) unless the caller already made one, and destroyed by `close`
only when it was made here.
"""

from __future__ import annotations

import os

from services.trainer.config import TrainerSettings


class World:
    """rank / world_size / device, from torchrun's environment (a single process otherwise)."""

    def __init__(self, settings: TrainerSettings):
        import torch
        import torch.distributed as dist

        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and self.world_size > 1:
            device = f"cuda:{self.local_rank}"
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.owns_group = False
        if self.world_size > 1 and not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend)
            self.owns_group = True
        self.distributed = self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()
