"""The trainer's weight-sync probe, the metrics it publishes and the behaviour-mismatch guard,
on the real tiny model (no sampler: test_integration.py has the trainer against one)."""

from __future__ import annotations

import copy
import json
import logging
import math

import numpy as np
import pytest
import torch

from services.trainer import checkpoint as ckpt
from services.trainer.config import TrainerSettings
from services.trainer.entrypoint import main as trainer_main
from services.trainer.mismatch import BehaviourMismatchError, MismatchGuard
from services.trainer.probe import compute_probe, probe_token_ids, saved_dtype
from services.trainer.step_record import published_metrics
from shared.probe import Probe, compare
from shared.settings import build
from shared.wire import MAX_METRICS, WeightsVersionRequest
from tests.trainer.conftest import make_samples

pytestmark = pytest.mark.timeout(120)

IDS = [5, 17, 42, 8, 63, 21, 9, 77, 30, 12, 55, 6]


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)


def _independent(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, one position at a time from the full forward's logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    return [float(torch.log_softmax(logits[i - 1], -1)[ids[i]]) for i in range(1, len(ids))]


def test_compute_probe_matches_an_independent_forward_and_follows_the_weights(base_model) -> None:
    model = copy.deepcopy(base_model)
    probe = compute_probe(model, IDS)
    assert probe["token_ids"] == IDS and probe["dtype"] == "float32"
    assert probe["logprobs"][0] is None and len(probe["logprobs"]) == len(IDS)
    expected = _independent(model, IDS)
    np.testing.assert_allclose(probe["logprobs"][1:], expected, atol=1e-5, rtol=0)
    # What the sampler does with it: a server computing these numbers passes, within float32's 1e-3.
    checked = compare(Probe.model_validate(probe), expected)
    assert checked.ok and checked.max_abs_diff < 1e-5, checked

    # One AdamW step later the probe is a different one, and still the new weights' logprobs.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = -torch.log_softmax(model(input_ids=torch.tensor([IDS])).logits[0, :-1], -1)[
        torch.arange(len(IDS) - 1), torch.tensor(IDS[1:])].sum()
    loss.backward()
    opt.step()
    after = compute_probe(model, IDS)
    np.testing.assert_allclose(after["logprobs"][1:], _independent(model, IDS), atol=1e-5, rtol=0)
    moved = max(abs(a - b) for a, b in zip(after["logprobs"][1:], probe["logprobs"][1:]))
    assert moved > 1e-2, moved
    # ... and the old weights' probe would take a server that serves the new weights out of rotation.
    assert not compare(Probe.model_validate(probe), after["logprobs"][1:]).ok


def test_compute_probe_is_deterministic_and_restores_train_mode(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32,
                                                 attention_dropout=0.5)
    model.train()
    first, second = compute_probe(model, IDS), compute_probe(model, IDS)
    assert model.training
    # Dropout is on in train mode: equal probes mean it ran in eval mode.
    assert first["logprobs"] == second["logprobs"]
    model.eval()
    np.testing.assert_allclose(first["logprobs"][1:], _independent(model, IDS), atol=1e-5, rtol=0)


def test_probe_dtype_is_the_dtype_the_checkpoint_holds(base_model, tmp_path) -> None:
    from safetensors import safe_open

    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        model = copy.deepcopy(base_model).to(dtype)
        probe = compute_probe(model, IDS)
        assert probe["dtype"] == saved_dtype(model) == name
        assert all(x is None or (math.isfinite(x) and x <= 0) for x in probe["logprobs"])
        Probe.model_validate(probe)
        path = ckpt.save_checkpoint(tmp_path / name, 0, model)
        with safe_open(str(path / "model.safetensors"), "pt") as fh:
            saved = {fh.get_tensor(key).dtype for key in fh.keys()}
        assert saved == {dtype}, saved
    # The dtype can also be named explicitly.
    assert compute_probe(base_model, IDS, "bfloat16")["dtype"] == "bfloat16"


def test_probe_token_ids_take_prompt_then_completion_up_to_the_limit() -> None:
    sample = make_samples(1, seed=2, max_prompt=5, max_completion=6)[0]
    sample = sample.model_copy(update={"prompt_token_ids": [10, 11, 12], "completion_token_ids": [20, 21, 22, 23]})
    assert probe_token_ids(sample, 64) == [10, 11, 12, 20, 21, 22, 23]
    assert probe_token_ids(sample, 5) == [10, 11, 12, 20, 21]
    assert probe_token_ids(sample, 2) == [10, 11]
    assert probe_token_ids(sample, 0) is None  # disabled
    as_arrays = sample.model_copy(update={"prompt_token_ids": np.array([10, 11, 12], dtype=np.int32),
                                          "completion_token_ids": np.array([20, 21], dtype=np.int32)})
    got = probe_token_ids(as_arrays, 64)
    assert got == [10, 11, 12, 20, 21] and all(type(t) is int for t in got)
    one = sample.model_copy(update={"prompt_token_ids": [10], "completion_token_ids": []})
    assert probe_token_ids(one, 64) is None  # nothing to compare
    with pytest.raises(ValueError, match="at least 2"):
        compute_probe(torch.nn.Linear(1, 1), [3])


def test_published_metrics_keep_finite_numbers_only() -> None:
    record = {"event": "step", "step": 3, "version": 4, "loss": -0.5, "behaviour_mismatch": 1e-4,
              "batch_digest": "abc", "tokens_per_s": None, "flag": True, "bad": math.nan, "worse": math.inf,
              "samples": 8}
    got = published_metrics(record)
    assert got == {"step": 3, "loss": -0.5, "behaviour_mismatch": 1e-4, "samples": 8}
    many = published_metrics({f"k{i}": float(i) for i in range(MAX_METRICS + 36)})
    assert len(many) == MAX_METRICS and list(many)[-1] == f"k{MAX_METRICS - 1}"  # the first ones, in order
    # The sampler's request model accepts both.
    WeightsVersionRequest(version=4, checkpoint_path="/x", metrics=got)
    WeightsVersionRequest(version=4, checkpoint_path="/x", metrics=many)


# -- the behaviour-mismatch guard ------------------------------------------------------


def test_guard_warns_each_step_above_and_stops_after_patience(caplog) -> None:
    records: list[dict] = []
    guard = MismatchGuard(0.2, 3, on_warning=records.append)
    with caplog.at_level(logging.WARNING, logger="tandem.trainer.mismatch"):
        guard.observe(0, 1e-4)
        guard.observe(1, 0.5)
        guard.observe(2, 0.6)
        guard.observe(3, 0.1)  # back below: the count starts again
        guard.observe(4, 0.7)
        guard.observe(5, 0.8)
        assert not records[-1]["stopping"]
        with pytest.raises(BehaviourMismatchError) as info:
            guard.observe(6, 0.9)
    assert [r["step"] for r in records] == [1, 2, 4, 5, 6]
    assert [r["consecutive"] for r in records] == [1, 2, 1, 2, 3]
    assert records[-1] == {"event": "behaviour_mismatch", "step": 6, "behaviour_mismatch": 0.9, "threshold": 0.2,
                           "consecutive": 3, "patience": 3, "stopping": True}
    json.dumps(records)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 5 and all("differ from the ones the inference servers reported" in w for w in warnings)
    assert "0.5 nats > max_behaviour_mismatch 0.2 at step 1 (1 of 3" in warnings[0]
    error = info.value
    assert error.value == 0.9 and error.threshold == 0.2 and error.steps == [4, 5, 6]
    message = str(error)
    for needle in ("0.9 nats", "(0.2 nats)", "3 consecutive steps", "steps 4..6", "docs/vllm.md", "dtype",
                   "max_behaviour_mismatch=0", "checkpoint of step 6"):
        assert needle in message, (needle, message)


def test_guard_edge_cases() -> None:
    off = MismatchGuard(0.0, 1)
    for step in range(10):
        off.observe(step, 50.0)  # disabled: never raises
    once = MismatchGuard(0.2, 1, announce=False)
    once.observe(0, 0.2)  # equal is not above
    once.observe(1, None)  # no value: nothing to judge
    with pytest.raises(BehaviourMismatchError):
        once.observe(2, math.nan)  # broken logprobs count as a mismatch
    with pytest.raises(ValueError):
        MismatchGuard(-1.0, 1)
    with pytest.raises(ValueError):
        MismatchGuard(0.2, 0)


def test_settings_defaults_and_limits() -> None:
    s = build(TrainerSettings, {"model": "m"})
    assert (s.probe_tokens, s.max_behaviour_mismatch, s.behaviour_mismatch_patience) == (64, 0.2, 5)
    s = build(TrainerSettings, {"model": "m", "probe_tokens": "0", "max_behaviour_mismatch": "0",
                                "behaviour_mismatch_patience": "1"})
    assert (s.probe_tokens, s.max_behaviour_mismatch, s.behaviour_mismatch_patience) == (0, 0.0, 1)
    for bad in ({"probe_tokens": "1"}, {"probe_tokens": "5000"}, {"max_behaviour_mismatch": "-0.1"},
                {"behaviour_mismatch_patience": "0"}):
        with pytest.raises(SystemExit):
            build(TrainerSettings, {"model": "m", **bad})


def test_cli_exits_3_with_the_message_when_the_guard_stops(monkeypatch, tmp_path, capsys) -> None:
    import services.trainer.trainer as trainer_module

    def stopped(settings):
        raise BehaviourMismatchError("behaviour_mismatch was above ... max_behaviour_mismatch=0", value=1.0,
                                     threshold=0.2, steps=[0])

    monkeypatch.setattr(trainer_module, "run", stopped)
    model = tmp_path / "model"  # the entrypoint checks --model is a model directory before `run`
    model.mkdir()
    (model / "config.json").write_text("{}")
    code = trainer_main(["--model", str(model), "--run-dir", str(tmp_path), "--no-progress"], prog="tandem trainer")
    assert code == 3
    assert "tandem trainer: behaviour_mismatch was above" in capsys.readouterr().err


class _Reply:
    def __init__(self, body):
        self.body = body

    def json(self):
        if isinstance(self.body, Exception):
            raise self.body
        return self.body


def test_a_reload_answer_gives_the_probe_when_it_carries_one() -> None:
    """reload_probe: the probe result from a `tandem_reload_weights` answer with `probe`; None
    (probe apart) when the answer has none; a failed result when what it carries is unusable."""
    from shared.probe import reload_probe

    probe = Probe(token_ids=[5, 17, 42], logprobs=[None, -1.0, -2.0])
    rows = [None, {"17": {"logprob": -1.0}}, {"42": {"logprob": -2.0004}}]
    good = _Reply({"results": [{"weight_version": "3", "probe": {"choices": [{"prompt_logprobs": rows}]}}]})
    result = reload_probe(probe, good)
    assert result is not None and result.ok and result.max_abs_diff == pytest.approx(4e-4)
    off = _Reply({"results": [{"probe": {"choices": [{"prompt_logprobs": [None, rows[1], {"42": {"logprob": -3}}]}]}}]})
    assert not reload_probe(probe, off).ok
    short = _Reply({"results": [{"probe": {"choices": [{"prompt_logprobs": rows[:2]}]}}]})
    assert "inline probe" in reload_probe(probe, short).error
    for without in ({"results": [{"weight_version": "3"}]}, {"results": [None]}, {}, ValueError("not JSON")):
        assert reload_probe(probe, _Reply(without)) is None
    assert reload_probe(None, good) is None and reload_probe(probe, None) is None
