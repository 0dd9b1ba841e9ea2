"""Settings precedence: flag > TANDEM_ env var > TOML file > default; lists; errors."""

from __future__ import annotations

from typing import ClassVar

import pytest
from pydantic import Field

from shared.settings import CommaList, SettingsError, TandemSettings, build, load


class Demo(TandemSettings):
    section: ClassVar[str] = "demo"
    steps: int = 10
    urls: CommaList = Field(default_factory=lambda: ["http://x:1"])
    on_policy: bool = False
    name: str = "default"


@pytest.fixture
def toml(tmp_path):
    path = tmp_path / "tandem.toml"
    path.write_text('steps = 20\nname = "flat"\n[demo]\nname = "section"\nurls = ["http://a:1", "http://b:2"]\n')
    return path


def test_defaults():
    s = load(Demo, [])
    assert (s.steps, s.urls, s.on_policy, s.name) == (10, ["http://x:1"], False, "default")


def test_toml_flat_and_section(toml):
    s = load(Demo, ["--config", str(toml)])
    assert s.steps == 20
    assert s.name == "section"  # the service's own section wins over flat keys
    assert s.urls == ["http://a:1", "http://b:2"]


def test_env_beats_toml_and_flag_beats_env(toml, monkeypatch):
    monkeypatch.setenv("TANDEM_STEPS", "30")
    monkeypatch.setenv("TANDEM_URLS", "http://e:1,http://f:2")
    s = load(Demo, ["--config", str(toml)])
    assert s.steps == 30 and s.urls == ["http://e:1", "http://f:2"]
    s = load(Demo, ["--config", str(toml), "--steps", "40", "--urls", "http://g:1"])
    assert s.steps == 40 and s.urls == ["http://g:1"]


def test_lists_accept_commas_and_repeats():
    assert load(Demo, ["--urls", "http://a:1, http://b:2"]).urls == ["http://a:1", "http://b:2"]
    assert load(Demo, ["--urls", "http://a:1", "--urls", "http://b:2,http://c:3"]).urls == [
        "http://a:1", "http://b:2", "http://c:3"]


def test_booleans():
    assert load(Demo, ["--on-policy"]).on_policy is True
    assert load(Demo, ["--no-on-policy"]).on_policy is False


def test_errors_name_the_flag_and_the_variable(tmp_path):
    with pytest.raises(SettingsError) as info:
        load(Demo, ["--steps", "many"])
    assert "--steps" in str(info.value) and "TANDEM_STEPS" in str(info.value)
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = [")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load(Demo, ["--config", str(bad)])
    with pytest.raises(SettingsError, match="does not exist"):
        load(Demo, ["--config", str(tmp_path / "missing.toml")])
    typo = tmp_path / "typo.toml"
    typo.write_text("[demo]\nstepz = 3\n")
    with pytest.raises(SettingsError, match="stepz"):
        build(Demo, {}, typo)
