"""LoRA runs (`lora_rank` > 0): a frozen base model, a trained low-rank adapter, published alone.

Why: AdamW state and gradients exist for the adapter only, and each version the inference
servers load is a few MB of adapter instead of the whole model (shared/adapters.py is the
layout the sampler and the servers expect).

* **set-up** (`attach`): the base loads in float32 as for full fine-tuning and is frozen; peft
  puts LoRA layers into the `lora_target_modules` (PEFT's initialisation: lora_B = 0, so base +
  the untrained adapter = base = version 0), and their float32 parameters are the only ones that
  train (master weights, as in a full run). The trainer goes on training the Hugging Face model
  itself, with the LoRA layers inside it: its forward (`logits_to_keep`), its decoder layers
  (FSDP's unit) and its parameter names are the ones the rest of the trainer knows. The
  `PeftModel` around it is kept for what only peft knows: the adapter switched off, and PEFT's
  tensor names.
* **reference model** (`beta` > 0): the same model with the adapter disabled
  (`PeftModel.disable_adapter`), which is exactly the starting model, without a second copy.
* **publication** (`LoraRun.publish`): `publish_dir/version-V` holds the adapter alone in PEFT's
  format, in `publish_dtype`, written like full weights (checkpoint.write_version: atomic, NaN
  and infinity refused), with `"adapter": true` in published.json.
* **checkpoints**: `run_dir/checkpoints/step-N` holds the adapter in float32 (the same format)
  instead of the model, the optimizer state as in a full run, and trainer_state.json records
  `lora` (rank, alpha, dropout, target modules) and `base_model`. A resume loads the base from
  `model` and the adapter from the checkpoint, and refuses a checkpoint of other LoRA settings,
  of another base, or of the other kind of run (`check_resume`).
* **export** (`merge`): base + adapter as one ordinary model directory (`tandem export
  --merge`, services/trainer/export.py).

Importing this module imports neither torch nor peft: the settings use its names.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_dir
from shared.settings import SettingsError

log = logging.getLogger("tandem.trainer.lora")

ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer except the output layer
# The attention and MLP projections of Llama-style models: what vLLM serves LoRA on.
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# vLLM loads LoRA weights for the attention and MLP layers; on the output layer or the
# embeddings an adapter needs extra serving options (and a vocabulary-sized tensor every
# version), so they are never trained here.
NOT_SERVED = ("lm_head", "embed_tokens", "embed_in", "embed_out", "wte", "wpe", "word_embeddings")
ADAPTER_NAME = "default"  # peft's name for the one adapter; PEFT's files leave it out of the keys
PEFT_PREFIX = "base_model.model."  # PEFT's names = this + the Hugging Face model's names
STATE_KEYS = ("lora", "base_model")  # what trainer_state.json records of a LoRA run
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")
PEFT_MISSING = ("LoRA needs the peft package, which is not installed: pip install -e '.[cpu]' (it pins peft), "
                "or set lora_rank 0 to train the full model")


def target_module_problem(names: Sequence[str]) -> str | None:
    """What is wrong with a list of LoRA target modules, in a sentence naming the fix; None if
    nothing is."""
    names = list(names)
    if not names:
        return (f"lora_target_modules is empty: name the linear layers the adapter trains (default "
                f"{','.join(DEFAULT_TARGET_MODULES)}), or {ALL_LINEAR}")
    if ALL_LINEAR in names and len(names) > 1:
        return f"lora_target_modules: {ALL_LINEAR} means every linear layer but the output layer; give it alone"
    bad = [n for n in names if n != ALL_LINEAR and not _MODULE_NAME.match(n)]
    if bad:
        return f"lora_target_modules {bad} are not module names (letters, digits, _ and ., e.g. q_proj)"
    unserved = [n for n in names if n.split(".")[-1] in NOT_SERVED]
    if unserved:
        return (f"lora_target_modules {unserved}: vLLM serves LoRA on the attention and MLP projections, not on "
                "the output layer or the embeddings; leave them out")
    return None


def peft_config_problem(config: Any) -> str | None:
    """What in a peft config (TRL's `peft_config`) the inference servers could not serve, in a
    sentence naming the fix; None when nothing."""
    from peft import LoraConfig

    if not isinstance(config, LoraConfig):
        return (f"peft_config is a {type(config).__name__}: the inference servers load LoRA adapters only "
                "(peft.LoraConfig)")
    if config.modules_to_save:
        return (f"peft_config.modules_to_save {sorted(config.modules_to_save)}: only the LoRA tensors reach the "
                "inference servers, so fully trained modules would never be served; leave it unset")
    if config.use_dora:
        return "peft_config.use_dora: vLLM does not serve DoRA adapters; set use_dora=False"
    if config.bias != "none" or config.lora_bias:
        return "peft_config trains biases (bias / lora_bias): vLLM does not serve LoRA biases; use bias='none'"
    targets = config.target_modules
    if targets is None:
        return "peft_config.target_modules is unset: name the layers (e.g. q_proj,v_proj) or all-linear"
    if isinstance(targets, str):
        if targets != ALL_LINEAR:
            return (f"peft_config.target_modules {targets!r} is a pattern: give a list of module names or "
                    f"{ALL_LINEAR!r}")
        targets = [targets]
    return target_module_problem(sorted(targets))


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA run's settings, as the adapter is built from them and checkpoints record them."""

    rank: int
    alpha: int
    dropout: float
    target_modules: tuple[str, ...]

    @classmethod
    def of(cls, settings: Any) -> LoraSpec | None:
        """The spec of TrainerSettings; None for a full fine-tuning run (lora_rank 0)."""
        if not settings.lora_rank:
            return None
        return cls(rank=settings.lora_rank, alpha=settings.lora_alpha or 2 * settings.lora_rank,
                   dropout=settings.lora_dropout, target_modules=tuple(settings.lora_target_modules))

    def record(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": list(self.target_modules)}

    def peft_config(self, base_model: str, targets: Sequence[str]) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=list(targets),
                          bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model)


# -- the run's adapter -------------------------------------------------------------------------


class LoraRun:
    """The adapter of a LoRA run and the `PeftModel` that knows it; `model` is what trains."""

    def __init__(self, peft_model: Any, spec: LoraSpec, base_model: str):
        self.peft_model = peft_model
        self.spec = spec
        self.base_model = base_model

    @property
    def model(self) -> Any:
        """The Hugging Face model, LoRA layers inside: what the learner trains and FSDP shards."""
        return self.peft_model.base_model.model

    def reference(self) -> Any:
        """Context: the model computes as the base (the adapter off), for the KL term."""
        return self.peft_model.disable_adapter()

    def record(self) -> dict[str, Any]:
        """What trainer_state.json keeps of the run, for `check_resume`."""
        return {"lora": self.spec.record(), "base_model": self.base_model}

    def peft_state(self, trained: dict[str, Any]) -> dict[str, Any]:
        """`trained` (the Hugging Face model's names: sharding.full_state_dict(trainable_only=True))
        keyed like the PeftModel's state dict."""
        return {PEFT_PREFIX + name: t for name, t in trained.items()}

    def publish(self, publish_root: Path | str, version: int, trained: dict[str, Any], *, dtype: Any,
                step: int) -> Path:
        return publish_peft(publish_root, version, self.peft_model, self.peft_state(trained), dtype=dtype, step=step)

    def checkpoint_writer(self, trained: dict[str, Any]) -> Callable[[Path], None]:
        """What writes the adapter into a checkpoint directory: float32, the masters themselves."""
        import torch

        from services.trainer.checkpoint import cast_tensors

        tensors = cast_tensors(peft_tensors(self.peft_model, self.peft_state(trained)), torch.float32)
        config = saved_config(self.peft_model)
        return lambda directory: save_adapter(directory, tensors, config)

    def load(self, directory: Path | str) -> None:
        """The adapter saved in `directory` into this run's LoRA parameters (before sharding)."""
        load_adapter(self.peft_model, directory)


def base_name(model: str) -> str:
    """How the base model is recorded: a directory by its absolute path, a hub name as it is."""
    path = Path(model)
    return str(path.resolve()) if path.is_dir() else model


def attach(model: Any, spec: LoraSpec, base_model: str) -> LoraRun:
    """Freeze `model` (float32) and put a fresh LoRA adapter into it; returns the run's adapter."""
    import torch

    try:
        from peft import get_peft_model
    except ImportError as exc:
        raise SettingsError(PEFT_MISSING) from exc
    targets = resolve_targets(model, spec.target_modules)
    with warnings.catch_warnings():
        # peft asks transformers under the deprecated name; nothing for the user to do.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, spec.peft_config(base_model, targets))
    for param in peft_model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()  # master weights, whatever the base came in
    return LoraRun(peft_model, spec, base_model)


def resolve_targets(model: Any, targets: Sequence[str]) -> list[str]:
    """The target modules as names: `all-linear` becomes the model's linear layers but the output
    layer (by their last name, as PEFT configs usually say them: vLLM reads them so too). A name
    the model lacks is refused, naming the ones it has (SettingsError)."""
    import torch

    output = model.get_output_embeddings()
    names = [name for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and module is not output]
    if tuple(targets) == (ALL_LINEAR,):
        return sorted({n.rsplit(".", 1)[-1] for n in names} - set(NOT_SERVED))
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        have = sorted({n.rsplit(".", 1)[-1] for n in names} - set(NOT_SERVED))
        raise SettingsError(f"lora_target_modules {missing}: {type(model).__name__} has no such linear layer; "
                            f"its linear layers are {','.join(have)} (or use {ALL_LINEAR})")
    return list(targets)


# -- PEFT's files ------------------------------------------------------------------------------


def peft_tensors(peft_model: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The adapter tensors of `state_dict` (keyed like `peft_model.state_dict()`) under PEFT's
    file names: `base_model.model.<module>.lora_A.weight`, no adapter name in the key."""
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: "auto" would look the base model up (on the hub for a name).
    return get_peft_model_state_dict(peft_model, state_dict=state_dict, adapter_name=ADAPTER_NAME,
                                     save_embedding_layers=False)


def saved_config(peft_model: Any) -> Any:
    """The LoraConfig saved with the weights: the target modules as peft resolved them
    (`all-linear` becomes names), sorted, in inference mode."""
    config = copy.deepcopy(peft_model.peft_config[ADAPTER_NAME])
    config.target_modules = sorted(config.target_modules)
    config.inference_mode = True
    return config


def save_adapter(directory: Path | str, tensors: dict[str, Any], config: Any) -> Path:
    """adapter_model.safetensors + adapter_config.json into `directory`; returns the weights file."""
    from safetensors.torch import save_file

    directory = Path(directory)
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config.save_pretrained(str(directory))
    return directory / ADAPTER_WEIGHTS


def publish_adapter(publish_root: Path | str, version: int, tensors: dict[str, Any], config: Any, *,
                    dtype: Any, step: int) -> Path:
    """Version `version` as the adapter alone (PEFT names, `dtype`), atomically, like full weights."""
    from services.trainer import checkpoint as ckpt

    tensors = ckpt.cast_tensors(tensors, dtype)
    return ckpt.write_version(publish_root, version, tensors, dtype=dtype, step=step,
                              write=lambda tmp: save_adapter(tmp, tensors, config), marker={"adapter": True})


def publish_peft(publish_root: Path | str, version: int, peft_model: Any, state_dict: dict[str, Any], *,
                 dtype: Any, step: int) -> Path:
    """Version `version` of `peft_model`'s adapter (`state_dict`: keyed like the PeftModel's, the
    base's tensors may be in it too) as `publish_root/version-V` (`publish_adapter`)."""
    return publish_adapter(publish_root, version, peft_tensors(peft_model, state_dict), saved_config(peft_model),
                           dtype=dtype, step=step)


def _live_adapter(peft_model: Any) -> dict[str, Any]:
    """PEFT file name -> the live parameter it is loaded into."""
    return peft_tensors(peft_model, {n: p for n, p in peft_model.named_parameters() if "lora_" in n})


def fit_problem(live: dict[str, Any], saved: dict[str, Any]) -> str | None:
    """How the saved adapter tensors do not fit the model's LoRA parameters; None if they do."""
    extra = sorted(set(saved) - set(live))
    missing = sorted(set(live) - set(saved))
    shapes = [f"{k}: saved {list(saved[k].shape)}, model {list(live[k].shape)}"
              for k in sorted(set(live) & set(saved)) if tuple(saved[k].shape) != tuple(live[k].shape)]
    if extra:
        return f"{len(extra)} saved tensor(s) have no place in the model, e.g. {extra[0]}"
    if missing:
        return f"{len(missing)} of the model's LoRA tensors are not in the adapter, e.g. {missing[0]}"
    if shapes:
        return f"{len(shapes)} tensor(s) differ in shape, e.g. {shapes[0]}"
    return None


def load_adapter(peft_model: Any, directory: Path | str) -> None:
    """Copy the adapter saved in `directory` into `peft_model`'s LoRA parameters; ValueError,
    saying what does not fit, when it is no adapter or not one of this model's shape."""
    import torch
    from safetensors.torch import load_file

    directory = Path(directory)
    if not is_adapter_dir(directory):
        raise ValueError(f"{directory} holds no LoRA adapter ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    saved = load_file(str(directory / ADAPTER_WEIGHTS))
    live = _live_adapter(peft_model)
    problem = fit_problem(live, saved)
    if problem:
        raise ValueError(f"the adapter in {directory} does not fit this model: {problem}")
    with torch.no_grad():
        for name, param in live.items():
            param.copy_(saved[name])


def read_adapter_config(directory: Path | str) -> dict[str, Any]:
    return json.loads((Path(directory) / ADAPTER_CONFIG).read_text())


# -- resume ------------------------------------------------------------------------------------


def _same_model(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a == b
    pa, pb = Path(a), Path(b)
    if pa.exists() or pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


def check_resume(state: dict[str, Any], spec: LoraSpec | None, base_model: str, where: Path | str) -> None:
    """Refuse (SettingsError) to resume this run from the checkpoint whose trainer_state.json is
    `state` when the two disagree on LoRA: one full and one LoRA, or other LoRA settings or base."""
    saved = state.get("lora")
    fresh = "start afresh instead (--no-resume, or another --run-dir)"
    if saved is None and spec is None:
        return
    if saved is None:
        raise SettingsError(f"checkpoint {where} is of a full fine-tuning run, but this run trains a LoRA adapter "
                            f"(lora_rank {spec.rank}): resume it with lora_rank 0, or {fresh}")
    if spec is None:
        raise SettingsError(f"checkpoint {where} holds a LoRA adapter (lora_rank {saved.get('rank')}), but this run "
                            f"has lora_rank 0 (full fine-tuning): resume it with its LoRA settings "
                            f"({_flags(saved)}), or {fresh}")
    mine = spec.record()
    differ = []
    for key in ("rank", "alpha", "dropout", "target_modules"):
        a, b = saved.get(key), mine[key]
        same = sorted(a or []) == sorted(b) if key == "target_modules" else a == b
        if not same:
            differ.append(f"lora_{key} {_show(a)} in the checkpoint, {_show(b)} now")
    if not _same_model(state.get("base_model"), base_model):
        differ.append(f"model (the base) {state.get('base_model')} in the checkpoint, {base_model} now")
    if differ:
        raise SettingsError(f"checkpoint {where} was trained with other settings than this run's: "
                            f"{'; '.join(differ)}. Resume with the checkpoint's ({_flags(saved)}, "
                            f"--model {state.get('base_model')}), or {fresh}")


def _show(value: Any) -> str:
    return ",".join(value) if isinstance(value, list) else str(value)


def _flags(saved: dict[str, Any]) -> str:
    return " ".join(f"--lora-{key.replace('_', '-')} {_show(saved.get(key))}"
                    for key in ("rank", "alpha", "dropout", "target_modules"))


# -- export ------------------------------------------------------------------------------------


def recorded_base(adapter_dir: Path | str) -> str | None:
    """The base model an adapter directory names: a checkpoint's trainer_state.json `base_model`,
    else adapter_config.json's `base_model_name_or_path`."""
    from services.trainer import checkpoint as ckpt

    adapter_dir = Path(adapter_dir)
    if (adapter_dir / ckpt.STATE_FILE).is_file():
        base = ckpt.read_state(adapter_dir).get("base_model")
        if base:
            return str(base)
    return read_adapter_config(adapter_dir).get("base_model_name_or_path") or None


def merge(adapter_dir: Path | str, out: Path | str, *, base: Path | str | None = None,
          dtype: str = "auto") -> Path:
    """Write base + the adapter in `adapter_dir` (a published version or a checkpoint of a LoRA
    run) as one Hugging Face model directory `out` (config, safetensors, the base's tokenizer
    files), atomically. `base`: default the one the adapter records. `dtype`: of the written
    weights, `auto` = the base's. ValueError, saying what to fix, for a directory that holds no
    adapter or a base the adapter does not fit."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from services.trainer import checkpoint as ckpt

    adapter_dir = Path(adapter_dir)
    if not is_adapter_dir(adapter_dir):
        raise ValueError(f"{adapter_dir} holds no LoRA adapter ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}): give a "
                         "published version or a checkpoint of a LoRA run (a full checkpoint exports without --merge)")
    recorded = recorded_base(adapter_dir)
    base = str(base) if base is not None else recorded
    if not base:
        raise ValueError(f"{adapter_dir} does not say which base model it was trained on: pass --base")
    if not (Path(base) / "config.json").is_file():
        raise ValueError(f"base model {base} is no model directory (no config.json): pass --base with the "
                         "directory the adapter was trained on")
    if recorded and not _same_model(recorded, base):
        log.warning("%s records base model %s; merging into %s", adapter_dir, recorded, base)
    hf_logging.disable_progress_bar()
    base_config = json.loads((Path(base) / "config.json").read_text())
    saved_dtype = base_config.get("dtype") or base_config.get("torch_dtype") or "float32"
    # Merged in float32 whatever the base is stored in, then cast once.
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig.from_pretrained(str(adapter_dir))
    config.inference_mode = False
    try:
        if not isinstance(config.target_modules, str):  # a pattern: peft says what it misses
            resolve_targets(model, sorted(config.target_modules))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft_model = get_peft_model(model, config)
        load_adapter(peft_model, adapter_dir)
    except (SettingsError, ValueError) as exc:
        raise ValueError(f"the adapter in {adapter_dir} does not fit base model {base}: {exc}. Pass --base with "
                         f"the model it was trained on{f' ({recorded})' if recorded else ''}") from None
    merged = peft_model.merge_and_unload()
    out_dtype = getattr(torch, saved_dtype if dtype == "auto" else dtype)
    merged = merged.to(out_dtype)

    def write(tmp: Path) -> None:
        merged.save_pretrained(str(tmp), safe_serialization=True)
        ckpt.copy_tokenizer_files(base, tmp)
        (tmp / "export.json").write_text(json.dumps(
            {"base_model": str(base), "adapter": str(adapter_dir), "merged": True,
             "dtype": str(out_dtype).removeprefix("torch.")}, indent=2))

    return ckpt.write_dir(Path(out), write)
