"""How the trainer's parameters, gradients and optimizer state live across ranks.

`make_sharding(kind, ...)` returns one of three strategies with the same interface, so the
learner and the checkpoint code never ask which one they have:

* **single** (`Sharding`, one process): nothing is distributed; every collective is a no-op.
* **ddp** (`DataParallel`): every rank holds the full model, gradients and AdamW state.
  After the backward passes, `reduce_gradients` SUMS every gradient over the ranks in flat
  buckets (one all-reduce per bucket). It is a sum, not torch DDP's mean, because every rank's
  loss is already divided by the *global* normaliser (all ranks, all micro-batches). This is
  the trainer's hand-written reduction rather than `torch.nn.parallel.DistributedDataParallel`:
  the sum is exact and explicit, gradient accumulation and several passes per batch (mu > 1)
  need no `no_sync` bookkeeping, the model is not wrapped (state-dict names stay the HF ones),
  and the reference model needs nothing. It costs DDP's overlap of communication with backward.
* **fsdp** (`FullyShardedDataParallel`): torch's FSDP2 (`fully_shard`). Every decoder layer
  and then the root module is sharded over the ranks, so each rank holds 1/world of the
  float32 parameters, gradients and AdamW state; the forward and backward all-gather one layer
  at a time, and the backward reduce-scatters the gradients (summed: gradient divide factor 1,
  plain SUM reductions, which gloo and NCCL both have). A bfloat16/float16 compute dtype is
  FSDP's `MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)` instead of autocast.
  Full weights are gathered (to rank 0, on the CPU) only for publication and checkpoints; the
  optimizer state is saved sharded (torch.distributed.checkpoint), never gathered.

With one process, `make_sharding` returns the single-process strategy whatever `kind` says.

Order of use (the trainer's): load the model (under fsdp on the CPU: `prepare` moves each
shard to the device), `prepare` it, THEN build the optimizer over the prepared model's
parameters (FSDP replaces them with DTensor shards), then `load_optimizer` on a resume.

Collectives: methods marked COLLECTIVE must be called by every rank, in the same order.
Under fsdp every forward of the policy or reference model is collective too (it all-gathers
the parameters), including a probe or eval forward: all ranks must run it, with inputs of any
shape.

Shared filesystem: `save_optimizer`/`load_optimizer` under fsdp have every rank write and read
its own shard files in the same directory, so every rank must see that directory at the same
path: on several nodes the checkpoint directory must be on shared storage.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("tandem.trainer.sharding")

KINDS = ("single", "ddp", "fsdp")
OPTIMIZER_FILE = "optimizer.pt"  # single/ddp: the whole AdamW state_dict, written by rank 0
OPTIMIZER_DIR = "optimizer"  # fsdp: a torch.distributed.checkpoint directory, one shard per rank
_DCP_METADATA = ".metadata"  # written last by dcp.save: marks a complete sharded save


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated transformer blocks, the unit FSDP shards and gathers one at a time.

    `model.model.layers` for Hugging Face causal LMs; otherwise the modules whose class is named
    in the model's `_no_split_modules`, or whose class name ends with "DecoderLayer". Inner
    modules come before the modules containing them (the order `fully_shard` needs).
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return list(layers)
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not found:
        found = [m for m in model.modules() if m is not model and type(m).__name__.endswith("DecoderLayer")]
    # modules() is pre-order, so reversed it lists descendants before their ancestors.
    keep = {id(m) for m in found}
    return [m for m in reversed(list(model.modules())) if id(m) in keep]


class Sharding:
    """The single-process strategy, and the interface of the others."""

    kind = "single"

    def __init__(self, *, rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu"):
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.compute_dtype: torch.dtype = torch.float32

    @property
    def distributed(self) -> bool:
        return False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def collective_device(self) -> torch.device:
        """Where tensors given to a collective must be: CUDA for NCCL, the CPU for gloo."""
        if self.distributed and dist.get_backend() == "nccl":
            return self.device
        return torch.device("cpu")

    # -- set-up ---------------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, *, compute_dtype: torch.dtype = torch.float32,
                ref_model: torch.nn.Module | None = None) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """Make `model` (float32 master weights) and the frozen `ref_model` ready to train with
        `compute_dtype`; returns them (the same objects: FSDP shards in place). Build the
        optimizer after this. Single/ddp: the models must already be on the device."""
        self.compute_dtype = compute_dtype
        return model, ref_model

    def autocast(self, device: torch.device | str | None = None) -> contextlib.AbstractContextManager:
        """Context for every forward (and the backward of its loss) in the compute dtype."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        device_type = torch.device(device if device is not None else self.device).type
        return torch.autocast(device_type, dtype=self.compute_dtype)

    # -- the step -------------------------------------------------------------------------

    def set_gradient_sync(self, model: torch.nn.Module, enabled: bool) -> None:
        """Whether the next backward reduces gradients over the ranks (fsdp only; a no-op
        elsewhere). The learner leaves it on: off, FSDP keeps every layer's whole float32
        gradient until the synced backward, the memory sharding is there to save."""

    def reshard(self, model: torch.nn.Module) -> None:
        """After a forward with no backward (a probe, a reference model, a step without signal):
        put the parameters back in their shards (fsdp only). FSDP leaves the root module's
        parameters gathered after its forward, expecting the backward to follow; left so, they
        are not the optimizer's parameters (saving its state fails) and cost the memory of the
        whole root (embeddings and LM head)."""

    def reduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum gradients over ranks after the last backward (ddp only: fsdp reduced them in
        the backward, a single process has nothing to reduce)."""

    def clip_grad_norm(self, params: Iterable[torch.nn.Parameter], max_norm: float | None) -> float:
        """The global (all-rank, full-model) L2 norm of the gradients before clipping, as a
        Python float on every rank; when `max_norm` is set, gradients are scaled to at most that
        norm. inf/nan come back as inf/nan (the gradients then turn inf/nan if clipped)."""
        params = [p for p in params if p.grad is not None]
        if not params:
            return 0.0
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)
        total = _full(total)  # fsdp: a DTensor over the shards; full_tensor() all-reduces it
        if max_norm:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    # -- collectives ----------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`tensor` summed ("sum") or maxed ("max") over the ranks, on the collective device.
        Use the return value: it is a new tensor when `tensor` had to move device."""
        if op not in ("sum", "max"):
            raise ValueError(f"unknown reduction {op!r}; expected 'sum' or 'max'")
        return tensor

    def broadcast_object(self, obj: Any) -> Any:
        """COLLECTIVE: rank 0's `obj` (picklable) on every rank."""
        return obj

    def barrier(self) -> None:
        """COLLECTIVE: wait for every rank."""

    # -- weights and optimizer state ------------------------------------------------------

    def full_state_dict(self, model: torch.nn.Module, *, trainable_only: bool = False
                        ) -> dict[str, torch.Tensor] | None:
        """COLLECTIVE: the full, unsharded weights on the CPU, keyed like the unwrapped HF
        model's `state_dict()` (so `save_pretrained(dir, state_dict=...)` works), on rank 0;
        None on the other ranks. Tied parameters (input embeddings and LM head) are one tensor
        under both names, as in `model.state_dict()`, so save_pretrained writes it once.
        `trainable_only`: only the parameters that train (a LoRA run's adapter: the frozen base
        is neither gathered nor copied). Single/ddp: tensors on the CPU already are not copied
        (they share storage with the live parameters): use them before the next optimizer step."""
        if not self.is_main:
            return None
        if trainable_only:
            return {name: p.detach().cpu() for name, p in model.named_parameters() if p.requires_grad}
        return _retie(model, {name: t.detach().cpu() for name, t in model.state_dict().items()})

    def save_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        """COLLECTIVE: write the optimizer state into `directory` (which must exist and be the
        same path on every rank). Single/ddp: rank 0 writes `optimizer.pt`."""
        if self.is_main:
            torch.save(optimizer.state_dict(), Path(directory) / OPTIMIZER_FILE)
        self.barrier()

    def load_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> bool:
        """COLLECTIVE: load the optimizer state saved in `directory` into `optimizer` (built over
        the prepared model, its parameters in the same order and groups as when saved); False,
        with the optimizer untouched, when there is none. Either format loads under every
        strategy (`optimizer.pt` of single/ddp, `optimizer/` of fsdp; this strategy's own first),
        so a resume may change the sharding or the number of ranks."""
        found = self.broadcast_object(_saved_optimizer(Path(directory), prefer_sharded=self.kind == "fsdp"))
        if found is None:
            return False
        if found.name == OPTIMIZER_DIR:
            _load_sharded_optimizer(model, optimizer, found)
        else:
            self._load_optimizer_file(model, optimizer, found)
        return True

    def _load_optimizer_file(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
        optimizer.load_state_dict(torch.load(path, map_location=self.device, weights_only=True))


def _saved_optimizer(directory: Path, prefer_sharded: bool) -> Path | None:
    """The optimizer state saved in `directory`: `optimizer/` (complete once dcp wrote its
    `.metadata`) or `optimizer.pt`, the preferred one when both are there; None if neither."""
    sharded, file = directory / OPTIMIZER_DIR, directory / OPTIMIZER_FILE
    found = [p for p in (sharded, file) if (p / _DCP_METADATA if p is sharded else p).is_file()]
    if len(found) == 2 and not prefer_sharded:
        found.reverse()
    return found[0] if found else None


def _load_sharded_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """COLLECTIVE: read a torch.distributed.checkpoint optimizer state (saved by fsdp, on any
    number of ranks) into `optimizer`, resharded to this model's layout: each rank reads the
    slices of its own shard (a full replica under single/ddp)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    # A state of the right shapes for dcp to read into; on a fresh optimizer this creates the
    # state with one zero-gradient, zero-lr step, which the load then overwrites.
    state = get_optimizer_state_dict(model, optimizer)
    with warnings.catch_warnings():
        # One process reading a sharded save is intended here, not a forgotten init_process_group.
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=not (dist.is_available() and dist.is_initialized()))
    set_optimizer_state_dict(model, optimizer, state)


def _by_parameter_name(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       saved: dict[str, Any]) -> dict[str, Any]:
    """`optimizer.state_dict()` format (parameters numbered in the optimizer's order) to the
    parameter-name keys of torch.distributed.checkpoint's full optimizer state dict."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    numbered = [i for group in saved["param_groups"] for i in group["params"]]
    if len(numbered) != len(order) or len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"saved optimizer state has {len(numbered)} parameters in {len(saved['param_groups'])} "
                         f"group(s); this optimizer {len(order)} in {len(optimizer.param_groups)}")
    name_of = dict(zip(numbered, order, strict=True))
    return {
        "state": {name_of[i]: value for i, value in saved["state"].items()},
        "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]}
                         for group in saved["param_groups"]],
    }


def _retie(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`full` with every name of a shared (tied) parameter mapped to one tensor: copying to
    the CPU or gathering shards makes a separate copy per name."""
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first and name in full and first[id(param)] in full:
            full[name] = full[first[id(param)]]
        first.setdefault(id(param), name)
    return full


def _full(total: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return total.full_tensor() if isinstance(total, DTensor) else total


class DataParallel(Sharding):
    """Full replicas on every rank; gradients summed by a bucketed all-reduce."""

    kind = "ddp"

    def __init__(self, *, rank: int, world_size: int, device: torch.device | str = "cpu",
                 bucket_bytes: int = 64 << 20):
        super().__init__(rank=rank, world_size=world_size, device=device)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{self.kind} sharding needs an initialised torch.distributed process group")
        self.bucket_bytes = bucket_bytes

    @property
    def distributed(self) -> bool:
        return True

    def reduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum every gradient over the ranks, in flat buckets of about `bucket_bytes` (one
        all-reduce each). A parameter without a gradient on this rank gets a zero one, so that
        every rank sends the same buckets."""
        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[torch.Tensor] = []
        size = 0
        for p in params:
            bucket.append(p.grad)
            size += p.grad.numel() * p.grad.element_size()
            if size >= self.bucket_bytes:
                self._reduce_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            self._reduce_bucket(bucket)

    def _reduce_bucket(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat = self.all_reduce(flat)
        at = 0
        for g in grads:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        super().all_reduce(tensor, op)
        tensor = tensor.to(self.collective_device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tensor

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()


class FullyShardedDataParallel(DataParallel):
    """FSDP2: parameters, gradients and optimizer state sharded over the ranks."""

    kind = "fsdp"

    def __init__(self, *, rank: int, world_size: int, device: torch.device | str = "cpu"):
        super().__init__(rank=rank, world_size=world_size, device=device)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (world_size,))

    def prepare(self, model: torch.nn.Module, *, compute_dtype: torch.dtype = torch.float32,
                ref_model: torch.nn.Module | None = None) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """`fully_shard` every decoder layer, then the root (which keeps the embeddings, the
        final norm and the LM head, tied or not), of the model and of the frozen reference
        model. The models may be on the CPU: each shard moves to the device as it is made."""
        self.compute_dtype = compute_dtype
        low = [n for n, p in model.named_parameters() if p.dtype in (torch.bfloat16, torch.float16)]
        if low:
            dtype = model.get_parameter(low[0]).dtype
            raise ValueError(f"fsdp trains float32 master weights, but {low[0]} is {dtype}: load the model "
                             "in float32 (the mixed-precision policy applies the compute dtype)")
        self._shard(model)
        if ref_model is not None:
            # Frozen: its parameters may be in the compute dtype already (no master weights).
            ref_model.requires_grad_(False)
            self._shard(ref_model)
        return model, ref_model

    def _shard(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(
            param_dtype=None if self.compute_dtype == torch.float32 else self.compute_dtype,
            reduce_dtype=torch.float32,
        )
        layers = decoder_layers(model)
        if not layers:
            log.warning("found no decoder layers in %s: sharding it as one unit (a full all-gather "
                        "per forward)", type(model).__name__)
        for layer in layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=mp)
        fully_shard(model, mesh=self.mesh, mp_policy=mp)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # A sum over ranks, not FSDP's default mean. Forcing SUM-only reductions is what
                # keeps gloo working: with a divide factor FSDP would otherwise use PREMUL_SUM,
                # which gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with Gloo").
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    def autocast(self, device: torch.device | str | None = None) -> contextlib.AbstractContextManager:
        # The mixed-precision policy casts the gathered parameters; autocast on top would also
        # cast inside float32 islands (e.g. the RMSNorm) and differ from the policy.
        return contextlib.nullcontext()

    def set_gradient_sync(self, model: torch.nn.Module, enabled: bool) -> None:
        # While off, each layer keeps its full unsharded gradient (float32) between backwards:
        # no communication, but a full-model gradient's memory on every rank.
        model.set_requires_gradient_sync(enabled)

    def reshard(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def reduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Nothing: the last backward (gradient sync on) reduce-scattered the gradients."""

    def full_state_dict(self, model: torch.nn.Module, *, trainable_only: bool = False
                        ) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Gathers one tensor at a time to rank 0's CPU memory; the others get {}. With
        # `trainable_only` the frozen parameters (a LoRA run's base) are not gathered at all.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        full = get_model_state_dict(model, options=options)
        if not self.is_main:
            return None
        if trainable_only:  # buffers, which ignore_frozen_params keeps, are no parameters that train
            trained = {name for name, p in model.named_parameters() if p.requires_grad}
            return {name: t for name, t in full.items() if name in trained}
        return _retie(model, full)

    def save_optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
        """COLLECTIVE: every rank writes its shard of the AdamW state into `directory/optimizer/`
        (torch.distributed.checkpoint; `.metadata` last, written by rank 0)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state = get_optimizer_state_dict(model, optimizer)
        dcp.save(state, checkpoint_id=Path(directory) / OPTIMIZER_DIR)

    def _load_optimizer_file(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
        """A single/ddp `optimizer.pt`: rank 0 reads it whole and sends each rank its shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full: dict[str, Any] = {}
        if self.is_main:
            full = _by_parameter_name(model, optimizer, torch.load(path, map_location="cpu", weights_only=True))
        set_optimizer_state_dict(model, optimizer, full,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def make_sharding(kind: str, *, distributed: bool, rank: int = 0, world_size: int = 1,
                  device: torch.device | str = "cpu") -> Sharding:
    """The strategy for `kind` ("ddp" or "fsdp"; "single" too) with an initialised process
    group when `distributed`; the single-process one otherwise, whatever `kind` says."""
    if kind not in KINDS:
        raise ValueError(f"unknown sharding {kind!r}; expected one of {KINDS}")
    if not distributed or kind == "single":
        if distributed:
            raise ValueError("sharding 'single' cannot run on several ranks; use ddp or fsdp")
        return Sharding(rank=0, world_size=1, device=device)
    if kind == "fsdp":
        return FullyShardedDataParallel(rank=rank, world_size=world_size, device=device)
    return DataParallel(rank=rank, world_size=world_size, device=device)
