"""Settings machinery shared by every Tandem service.

Each service declares one pydantic-settings class derived from `TandemSettings`. A
value comes from, highest precedence first: a CLI flag `--field-name`, an environment
variable `TANDEM_<FIELD>`, a TOML file given with `--config`, the field default.

TOML files may be flat (`max_staleness = 2`) or sectioned by service (`[sampler]`);
a section's values win over the flat ones. List-valued settings accept a JSON list,
a TOML array, repeated flags or one comma-separated string.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BeforeValidator, Field, JsonValue, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from shared import token_guard

ENV_PREFIX = "TANDEM_"

# The TOML values for the settings object being built right now; set only inside load().
_toml_values: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar(
    "tandem_toml_values", default={}
)


def _split_commas(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple)):
        out: list[Any] = []
        for item in value:
            out.extend(_split_commas(item) if isinstance(item, str) else [item])
        return out
    return value


# A list setting that also accepts "a,b,c" (from a flag, an env var or TOML).
CommaList = Annotated[list[str], NoDecode, BeforeValidator(_split_commas)]


def json_if_str(value: Any) -> Any:
    """Structured settings may come from a flag or env var as a JSON string."""
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else None
        except ValueError as exc:
            raise ValueError(f"expected JSON, got {value!r}: {exc}") from None
    return value


# An environment's keyword arguments (`env_args`): a JSON object (nested for a verifiers
# environment, whose arguments are its `[env]` block).
EnvArgs = Annotated[dict[str, JsonValue], BeforeValidator(json_if_str)]


class _TomlSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        values = _toml_values.get()
        return values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        fields = self.settings_cls.model_fields
        return {k: v for k, v in _toml_values.get().items() if k in fields}


class TandemSettings(BaseSettings):
    """Settings every service has."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="ignore", validate_default=True, case_sensitive=False
    )

    # The name of this service's section in a TOML file.
    section: typing.ClassVar[str] = ""

    host: str = "127.0.0.1"
    port: int = 0
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    run_dir: Path = Path("runs/default")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _TomlSource(settings_cls))


class GuardedSettings(TandemSettings):
    """Settings of a service that listens for the run (the sampler, the inference server): the
    run's token, and the start-up refusal to listen beyond loopback without one
    (shared/token_guard.py)."""

    api_token: str | None = Field(
        default=None, description="the run's token: every route but /health needs 'Authorization: Bearer <token>'"
    )
    insecure_no_token: bool = Field(
        default=False, description="listen beyond loopback without api_token, open to anyone who reaches the port"
    )

    def listen_refusal(self, service: str) -> str | None:
        """Why this service must not start as configured (exit 2), or None."""
        return token_guard.refusal(service, self.host, self.api_token, self.insecure_no_token)


S = TypeVar("S", bound=TandemSettings)


class SettingsError(SystemExit):
    """Raised (and exits with status 2) when settings are invalid; the message names the fix."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
        self.code = 2

    def __str__(self) -> str:
        return self.message


def read_toml(path: Path | str, section: str) -> dict[str, Any]:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
    flat = {k: v for k, v in data.items() if not isinstance(v, dict)}
    if section and isinstance(data.get(section), dict):
        flat.update(data[section])
    return flat


def _is_list(annotation: Any) -> bool:
    """A list of scalars (repeatable/comma flag); lists of objects are passed as one JSON string."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _is_list(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_is_list(a) for a in typing.get_args(annotation) if a is not type(None))
    if origin in (list, tuple, set):
        items = typing.get_args(annotation)
        return all(item in (str, int, float) for item in items) if items else True
    return False


def _is_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return bool in typing.get_args(annotation)
    return False


def add_arguments(parser: argparse.ArgumentParser, cls: type[TandemSettings]) -> None:
    """One flag per field, `--field-name`; only the flags given end up in the namespace."""
    parser.add_argument("--config", default=argparse.SUPPRESS, help="TOML settings file")
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = field.description or ""
        if _is_bool(field.annotation):
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS, help=help_text,
            )
        elif _is_list(field.annotation):
            parser.add_argument(
                flag, dest=name, action="append", default=argparse.SUPPRESS,
                help=(help_text + " (comma-separated or repeated)").strip(),
            )
        else:
            parser.add_argument(flag, dest=name, default=argparse.SUPPRESS, help=help_text)


def _explain(exc: ValidationError, cls: type[TandemSettings]) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "settings"
        where = f"--{loc.replace('_', '-')} / {ENV_PREFIX}{loc.upper()}" if loc in cls.model_fields else loc
        lines.append(f"  {where}: {err['msg']} (got {err.get('input')!r})")
    return f"invalid {cls.__name__} settings:\n" + "\n".join(lines)


def build(cls: type[S], cli: dict[str, Any] | None = None, config: Path | str | None = None) -> S:
    """Build settings from CLI values, the environment and an optional TOML file."""
    toml = read_toml(config, cls.section) if config else {}
    unknown = sorted(set(toml) - set(cls.model_fields))
    if unknown and cls.section:
        # Flat files are shared between services, so only a service's own section is strict.
        own = read_toml(config, "") if config else {}
        unknown = [k for k in unknown if k not in own]
    if unknown:
        raise SettingsError(f"config file {config}: unknown settings {unknown} for [{cls.section}]")
    token = _toml_values.set(toml)
    try:
        return cls(**(cli or {}))
    except ValidationError as exc:
        raise SettingsError(_explain(exc, cls)) from None
    finally:
        _toml_values.reset(token)


def load(cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None) -> S:
    """Parse `argv` as flags for `cls` and build the settings."""
    parser = argparse.ArgumentParser(prog=prog, description=cls.__doc__)
    add_arguments(parser, cls)
    ns = vars(parser.parse_args(list(argv) if argv is not None else None))
    config = ns.pop("config", None)
    return build(cls, ns, config)
