"""Start-up checks that cost a second, made before anything heavy loads (docs/settings.md, Trainer).

* `check_model`: `--model` is a Hugging Face model directory (one with a config.json), or the
  name of a model in the local Hugging Face cache (what `from_pretrained` loads without a
  network). Anything else stops the trainer with one line (exit status 2) naming the path,
  what is wrong and how to get a model, instead of transformers' traceback.
* `sampler_client`: the trainer's `SamplerClient`: it retries an unreachable or failing
  sampler for `retry_for` seconds, logs one line every `wait_log_interval` seconds saying
  what it waits for, and names these flags when it gives up.
* `check_token`: `GET /auth` with the trainer's `--api-token`; a missing or wrong token stops
  the trainer with one line naming the flag and the environment variable (exit status 2),
  before the model loads rather than after the first optimizer step.

Nothing here imports torch or transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.trainer.config import TrainerSettings
from shared.client import SamplerClient, Unauthorized
from shared.settings import SettingsError

INIT_MODEL = "`tandem init-model --preset tiny --out DIR` writes a small one"


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')} / TANDEM_{name.upper()}"


def _cached_hub_model(name: str) -> bool:
    """Whether `name` is a hub id whose config.json is in the local Hugging Face cache."""
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError
    except ImportError:  # pragma: no cover - transformers depends on it
        return False
    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except (HFValidationError, ValueError):
        return False


def check_model(model: str | Path, what: str = "--model") -> None:
    """Raise SettingsError (one line) unless `model` is a model directory or a cached hub model."""
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return
        raise SettingsError(
            f"{what} {model} is not a Hugging Face model directory (no config.json in it): give the directory "
            f"that holds config.json and the weights; {INIT_MODEL}")
    if path.exists():
        raise SettingsError(f"{what} {model} is a file, not a Hugging Face model directory; {INIT_MODEL}")
    if _cached_hub_model(str(model)):
        return
    raise SettingsError(
        f"{what} {model} does not exist (no such directory, and no model of that name in the local Hugging Face "
        f"cache; nothing is downloaded): give a model directory; {INIT_MODEL}")


def sampler_client(settings: TrainerSettings) -> SamplerClient:
    s = settings
    return SamplerClient(s.sampler_url, api_token=s.api_token, poll_timeout=s.poll_timeout, retry_for=s.retry_for,
                         report_every=s.wait_log_interval, retry_for_name=_flag("retry_for"),
                         timeout_name=_flag("batch_timeout"))


async def check_token(client: SamplerClient, settings: TrainerSettings) -> None:
    """Raise SettingsError (one line) when the sampler refuses the trainer's API token."""
    try:
        await client.check_token()
    except Unauthorized:
        where = f"the sampler at {settings.sampler_url}"
        if settings.api_token:
            raise SettingsError(
                f"{where} refused the API token: {_flag('api_token')} must be the sampler's api_token") from None
        raise SettingsError(
            f"{where} needs an API token: give the sampler's api_token with {_flag('api_token')}") from None


def refuse_trimmed(served: Any, start_step: int, resumed_from: Path | None, sampler_url: str) -> None:
    """SettingsError when the sampler (its `GET /weights_version` answer, `served`) has deleted
    batches this run needs from `start_step` on."""
    trimmed = (served.model_extra or {}).get("trimmed_below") or 0
    if start_step < trimmed:
        where = f"checkpoint {resumed_from}" if resumed_from else "no checkpoint in --run-dir"
        raise SettingsError(
            f"this run cannot continue from step {start_step} ({where}): the sampler at {sampler_url} is at "
            f"version {served.version} and has deleted its batches below step {trimmed}. Point --run-dir at the "
            f"run's own checkpoints (step {trimmed - 1} or later), or start afresh: the sampler with --fresh "
            "(or a new namespace / run_dir) and this trainer with --no-resume")

