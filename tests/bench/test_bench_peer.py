"""`bench peer` end to end at 2 steps, seed 0: `tandem demo` then plain TRL's GRPOTrainer, as in
tests/bench/test_bench_smoke.py (the numbers are meaningless at this size; only the results'
shape is checked). Results go to a temporary directory, never to bench/results."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_peer(tmp_path):
    pytest.importorskip("trl")
    from bench import bench_peer

    result = bench_peer.run(tmp_path, seeds=(0,), steps=2)
    assert (tmp_path / "peer.md").read_text().startswith("# ")
    written = json.loads((tmp_path / "peer.json").read_text())
    assert written["rows"] == json.loads(json.dumps(result["rows"]))
    rows = {r["system"]: r for r in written["rows"]}
    assert set(rows) == {"tandem", "trl"}
    for row in rows.values():
        assert row["ok"], row.get("error") or row.get("eval_error")
        assert row["steps"] == 2
        for key in ("seconds_to_steps", "steps_per_s", "wall_seconds", "eval_reward_after", "ratio_tandem_over_trl"):
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (row["system"], key, row[key])
        assert row["seconds_to_steps"] > 0 and 0.0 <= row["eval_reward_after"] <= 1.0
    trl = rows["trl"]
    assert trl["prompt_order_matches_demo"]
    assert trl["grpo_config"]["max_steps"] == 2 and trl["grpo_config"]["use_vllm"] is False
    assert trl["grpo_config"]["per_device_train_batch_size"] * trl["grpo_config"]["gradient_accumulation_steps"] == 128
    assert written["trl_version"] and written["differences"]
