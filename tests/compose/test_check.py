"""The compose check's own pieces, fast; and the whole check, only when asked for.

The real run (`make compose-check`, tests/compose/check.py) builds images and runs the CPU
stack under Docker: minutes, more than `make test` can spend on 2 cores, so here it runs only
with TANDEM_COMPOSE_CHECK=1 and is skipped otherwise, saying so.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgpack
import pytest
import yaml

from tests.compose import check, images
from tests.compose.engine import Engine
from tests.compose.stack import Stack, check_learns, check_no_batch_lost, host_addresses, refused

REPO = Path(__file__).resolve().parents[2]


def _batch(step: int, groups: list[str]) -> bytes:
    return msgpack.packb({"step": step, "samples": [{"group_id": g} for g in groups]})


def _records(steps: int, rewards: list[float] | None = None) -> list[dict]:
    rewards = rewards or [0.0] * steps
    return [{"event": "step", "step": s, "version": s + 1, "reward_mean": rewards[s]} for s in range(steps)]


def test_no_batch_lost_passes_a_whole_run() -> None:
    batches = {s: _batch(s, [f"g{s}a", f"g{s}b"]) for s in range(3)}
    assert check_no_batch_lost(3, _records(3), batches) == {"steps": 3, "groups": 6}


@pytest.mark.parametrize("what", ["gap", "unseen", "group twice"])
def test_no_batch_lost_catches(what: str) -> None:
    records, batches = _records(3), {s: _batch(s, [f"g{s}"]) for s in range(3)}
    if what == "gap":
        records[2]["step"], records[2]["version"] = 3, 4
    elif what == "unseen":
        del batches[1]
    else:
        batches[2] = _batch(2, ["g1"])
    with pytest.raises(AssertionError):
        check_no_batch_lost(3, records, batches)


def test_learning_is_the_reward_rising() -> None:
    assert check_learns(_records(20, [0.0] * 10 + [0.5] * 10)) == {"reward_first": 0.0, "reward_last": 0.5}
    with pytest.raises(AssertionError, match="train reward"):
        check_learns(_records(20, [0.1] * 20))


def test_the_kill_moments_vary_apart_and_leave_steps_after_them() -> None:
    import random
    drawn = [check.kill_moments(random.Random(seed), 60) for seed in range(200)]
    assert all(7 <= d["sampler"] <= 22 and 30 <= d["redis"] <= 45 for d in drawn), drawn
    assert len({d["sampler"] for d in drawn}) > 10 and len({d["redis"] for d in drawn}) > 10  # varied
    assert check.kill_moments(random.Random(5), 60) == check.kill_moments(random.Random(5), 60)  # the seed repeats them
    shortest = [check.kill_moments(random.Random(seed), check.MIN_STEPS) for seed in range(50)]
    assert all(2 <= d["sampler"] and d["sampler"] + 2 <= d["redis"] <= check.MIN_STEPS - 4 for d in shortest), shortest


def test_the_check_builds_and_stands_in_for_what_the_compose_file_names() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert compose["services"]["redis"]["image"] == check.REDIS_IMAGE
    build = images.compose_build("tandem:cpu")
    assert build["target"] == "cpu" and build["dockerfile"] == "docker/Dockerfile"


def test_the_stack_runs_on_the_compose_defaults_with_a_token_of_its_own() -> None:
    """The exposure phase expects the sampler on 127.0.0.1: the host's TANDEM_BIND (or any
    TANDEM_ variable) must not reach compose; and every request to the sampler carries the token."""
    stack = Stack(Engine(env={"PATH": "/usr/bin", "TANDEM_BIND": "0.0.0.0", "TANDEM_API_TOKEN": "host's"}), 16)
    assert "TANDEM_BIND" not in stack.env
    assert stack.env["TANDEM_API_TOKEN"] == stack.token != "host's"
    assert stack.auth == {"Authorization": f"Bearer {stack.token}"}
    assert stack.env["TANDEM_INFERENCE_PORT"] == str(stack.old_inference_port) != str(stack.sampler_port)
    compile(check.INFERENCE_PROBE, "probe", "exec")  # run by the sampler container's Python


def test_refused_tells_a_listening_port_from_a_closed_one() -> None:
    import socket
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert not refused("127.0.0.1", port)
    assert refused("127.0.0.1", port)
    assert not any(address.startswith("127.") for address in host_addresses())


def test_the_dockerfile_defaults_need_no_build_args() -> None:
    """The build args the check sets on a machine without registry or PyTorch index are
    overrides; a user's plain `docker compose build` gets the official base and CPU index."""
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in dockerfile
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile
    # No default: unset in a plain build, so pip sees no empty PIP_CERT / PIP_FIND_LINKS.
    assert re.search(r"^ARG PIP_CERT$", dockerfile, re.MULTILINE)
    assert re.search(r"^ARG PIP_FIND_LINKS$", dockerfile, re.MULTILINE)


@pytest.mark.skipif(not os.environ.get("TANDEM_COMPOSE_CHECK"),
                    reason="the real compose run takes minutes: `make compose-check` (or TANDEM_COMPOSE_CHECK=1)")
def test_compose_check_end_to_end() -> None:
    code = check.main([])
    if code == check.SKIPPED:
        pytest.skip("no Docker engine can run here (the check printed why)")
    assert code == 0
