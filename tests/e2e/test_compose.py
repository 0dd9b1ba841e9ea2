"""docker-compose.yml, docker/Dockerfile and .dockerignore, checked without a Docker engine.

The static part reads the compose file with PyYAML (which resolves the `<<` merge keys
the file uses, as Compose does) and checks the structure docs/docker.md promises: services
per profile, healthchecks behind every `service_healthy`, the vLLM flags of
docs/inference-api.md, GPU reservations, the checkpoint volume shared at the same path, the
batch shape, `${VAR:?}` for the API token, and nothing open on the host unless asked (no
inference port published, the sampler's on 127.0.0.1 unless TANDEM_BIND, vLLM guarded by the
mounted shared/token_guard.py). The second part runs `docker compose config` (or
`docker-compose config`) when such a command is installed, and is skipped otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is in the dev extra")

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
GPU = {"inference", "sampler", "trainer"}
CPU = {"model-init", "inference-cpu", "sampler-cpu", "trainer-cpu"}
DEFAULT = re.compile(r"^\$\{(\w+):-([^}]*)\}$")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def services(compose: dict) -> dict[str, dict]:
    return compose["services"]


def value(raw: object) -> str:
    """An environment value as Compose would see it with nothing set: `${X:-d}` -> d."""
    text = str(raw)
    match = DEFAULT.match(text)
    return match.group(2) if match else text


def test_services_and_profiles(compose: dict) -> None:
    svc = services(compose)
    assert set(svc) == {"redis"} | GPU | CPU
    assert "profiles" not in svc["redis"], "redis serves both stacks, so it has no profile"
    for name in GPU:
        assert svc[name]["profiles"] == ["gpu"], name
    for name in CPU:
        assert svc[name]["profiles"] == ["cpu"], name
    # `docker compose up` = the gpu profile, through the committed .env; --profile replaces it.
    env_file = (REPO / ".env").read_text()
    assert re.search(r"^COMPOSE_PROFILES=gpu$", env_file, re.MULTILINE), env_file


def test_redis_has_aof_and_a_healthcheck(compose: dict) -> None:
    redis = services(compose)["redis"]
    assert redis["image"].startswith("redis:")
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    # Acknowledged means durable: a sealed batch or a published version survives a kill -9.
    assert command[command.index("--appendfsync") + 1] == "always"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert any(v.endswith(":/data") for v in redis["volumes"]), "AOF must live on a volume"


def test_vllm_inference_is_the_official_image_with_the_design_flags(compose: dict) -> None:
    inference = services(compose)["inference"]
    assert inference["image"].startswith("vllm/vllm-openai:")
    assert str(inference["environment"]["VLLM_SERVER_DEV_MODE"]) == "1"
    command = " ".join(inference["command"])
    assert "vllm serve" in command
    for flag in ("--logprobs-mode processed_logprobs", "--generation-config vllm", "--port 8000"):
        assert flag in command, flag
    assert "/health" in " ".join(inference["healthcheck"]["test"])


@pytest.mark.parametrize("name", ["inference", "trainer"])
def test_gpu_services_reserve_a_gpu(compose: dict, name: str) -> None:
    devices = services(compose)[name]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] and d.get("driver") == "nvidia" for d in devices), devices


def test_cpu_services_reserve_no_gpu(compose: dict) -> None:
    for name in CPU | {"sampler"}:
        assert "deploy" not in services(compose)[name], name


def test_every_dependency_waits_for_a_healthy_or_finished_service(compose: dict) -> None:
    svc = services(compose)
    for name, spec in svc.items():
        deps = spec.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on must name conditions"
        for dep, cond in deps.items():
            assert dep in svc, f"{name} depends on unknown {dep}"
            # A dependency must exist whenever the dependant does: same profile, or none.
            assert svc[dep].get("profiles") in (None, spec.get("profiles")), f"{name} -> {dep}"
            condition = cond["condition"]
            if condition == "service_healthy":
                assert "healthcheck" in svc[dep], f"{name} waits for {dep}, which has no healthcheck"
            else:
                assert condition == "service_completed_successfully" and dep == "model-init", (name, dep)
    for name in ("sampler", "sampler-cpu"):
        assert svc[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert svc["sampler"]["depends_on"]["inference"]["condition"] == "service_healthy"
    assert svc["sampler-cpu"]["depends_on"]["inference-cpu"]["condition"] == "service_healthy"
    assert svc["trainer"]["depends_on"]["sampler"]["condition"] == "service_healthy"
    assert svc["trainer-cpu"]["depends_on"]["sampler-cpu"]["condition"] == "service_healthy"


def test_every_long_running_service_has_a_healthcheck_or_is_the_trainer(compose: dict) -> None:
    for name, spec in services(compose).items():
        if name not in ("trainer", "trainer-cpu", "model-init"):
            assert spec["healthcheck"]["test"], name


@pytest.mark.parametrize("trainer,inference", [("trainer", "inference"), ("trainer-cpu", "inference-cpu")])
def test_checkpoints_are_on_a_volume_the_inference_server_reads_at_the_same_path(
        compose: dict, trainer: str, inference: str) -> None:
    svc = services(compose)

    def mounts(name: str) -> dict[str, str]:
        out = {}
        for entry in svc[name]["volumes"]:
            source, target = entry.split(":")[:2]
            out[target] = source
        return out

    run_dir = svc[trainer]["environment"]["TANDEM_RUN_DIR"]
    trainer_mounts, inference_mounts = mounts(trainer), mounts(inference)
    target = next(t for t in trainer_mounts if run_dir.startswith(t.rstrip("/") + "/"))
    volume = trainer_mounts[target]
    assert volume in compose["volumes"], f"{volume} is not a named volume"
    assert inference_mounts.get(target) == volume, (
        f"{trainer} writes checkpoints under {run_dir} on volume {volume}; {inference} must mount it at {target}"
    )


@pytest.mark.parametrize("sampler,trainer", [("sampler", "trainer"), ("sampler-cpu", "trainer-cpu")])
def test_batch_shapes_agree(compose: dict, sampler: str, trainer: str) -> None:
    s = services(compose)[sampler]["environment"]
    t = services(compose)[trainer]["environment"]
    sampler_side = int(value(s["TANDEM_PROMPTS_PER_STEP"])) * int(value(s["TANDEM_NUM_GENERATIONS"]))
    trainer_side = int(value(t["TANDEM_PER_DEVICE_BATCH_SIZE"])) * int(value(t["TANDEM_GRAD_ACCUM_STEPS"]))
    assert sampler_side == trainer_side


def test_urls_point_at_the_right_stack(compose: dict) -> None:
    svc = services(compose)
    assert svc["sampler"]["environment"]["TANDEM_INFERENCE_URLS"] == "http://inference:8000"
    assert svc["sampler-cpu"]["environment"]["TANDEM_INFERENCE_URLS"] == "http://inference-cpu:8000"
    assert svc["trainer"]["environment"]["TANDEM_SAMPLER_URL"] == "http://sampler:8100"
    assert svc["trainer-cpu"]["environment"]["TANDEM_SAMPLER_URL"] == "http://sampler-cpu:8100"
    for name in ("sampler", "sampler-cpu"):
        assert svc[name]["environment"]["TANDEM_REDIS_URL"].startswith("redis://redis:")


def test_the_api_token_is_a_required_variable(compose: dict) -> None:
    required = re.compile(r"^\$\{TANDEM_API_TOKEN:\?.+\}$")
    for name in ("sampler", "trainer", "sampler-cpu", "trainer-cpu", "inference", "inference-cpu"):
        assert required.match(services(compose)[name]["environment"]["TANDEM_API_TOKEN"]), name
    # vLLM's own key (its /v1 routes) is the same token.
    assert required.match(services(compose)["inference"]["environment"]["VLLM_API_KEY"])


# -- nothing open on the host unless asked ------------------------------------------------

SAMPLER_PORTS = ["${TANDEM_BIND:-127.0.0.1}:${TANDEM_SAMPLER_PORT:-8100}:8100"]
GUARD_MOUNT = "./shared/token_guard.py:/tandem/tandem_token_guard.py:ro"


def test_only_the_sampler_publishes_a_port_and_on_loopback_by_default(compose: dict) -> None:
    for name, spec in services(compose).items():
        if name in ("sampler", "sampler-cpu"):
            assert spec["ports"] == SAMPLER_PORTS, name
        else:
            # The inference servers above all: only the sampler talks to them, over the compose network.
            assert "ports" not in spec, f"{name} publishes {spec['ports']}"


def test_vllm_loads_the_token_guard_from_the_mounted_file(compose: dict) -> None:
    inference = services(compose)["inference"]
    command = " ".join(inference["command"])
    assert "--middleware tandem_token_guard.VllmTokenGuard" in command
    assert GUARD_MOUNT in inference["volumes"]
    assert inference["environment"]["PYTHONPATH"] == "/tandem"
    source = GUARD_MOUNT.split(":")[0]
    assert (REPO / source).is_file(), source


def test_the_mounted_guard_runs_alone_in_a_bare_interpreter(tmp_path: Path) -> None:
    """The official vLLM image has no Tandem code: the mounted file, imported under its
    mounted name with nothing but the standard library (-S: no site-packages), builds with
    the app alone from TANDEM_API_TOKEN, keeps /health (the healthcheck's) open and closes
    the dev-mode routes; without the token it refuses to build."""
    (tmp_path / "tandem_token_guard.py").write_text((REPO / "shared" / "token_guard.py").read_text())
    script = f"""
import asyncio, sys
sys.path.insert(0, {str(tmp_path)!r})
from tandem_token_guard import VllmTokenGuard

async def app(scope, receive, send):
    await send({{"type": "http.response.start", "status": 200, "headers": []}})
    await send({{"type": "http.response.body", "body": b""}})

async def status(guard, path, headers=()):
    sent = []
    async def send(message):
        sent.append(message)
    async def receive():
        return {{"type": "http.request", "body": b""}}
    scope = {{"type": "http", "method": "POST", "path": path, "headers": list(headers), "server": ("x", 8000)}}
    await guard(scope, receive, send)
    return sent[0]["status"]

guard = VllmTokenGuard(app)
print(asyncio.run(status(guard, "/health")), asyncio.run(status(guard, "/pause")),
      asyncio.run(status(guard, "/pause", [(b"authorization", b"Bearer t0ken")])))
"""
    env = {"PATH": os.environ.get("PATH", ""), "TANDEM_API_TOKEN": "t0ken"}
    run = subprocess.run([sys.executable, "-I", "-S", "-c", script], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["200", "401", "200"]
    del env["TANDEM_API_TOKEN"]
    run = subprocess.run([sys.executable, "-I", "-S", "-c", script], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert run.returncode != 0 and "TANDEM_API_TOKEN" in run.stderr


def test_our_images_build_from_docker_dockerfile_targets(compose: dict) -> None:
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\w+)", dockerfile, re.MULTILINE | re.IGNORECASE))
    assert targets == {"cpu", "gpu"}
    for name, spec in services(compose).items():
        if "build" in spec:
            assert spec["build"]["dockerfile"] == "docker/Dockerfile"
            assert spec["build"]["target"] in targets, name
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in dockerfile
    assert "torch==2.13.0" in dockerfile
    # The dependency layer comes before the source, so code edits reuse it.
    assert dockerfile.index("COPY pyproject.toml") < dockerfile.index("COPY services")
    ignored = (REPO / ".dockerignore").read_text().split()
    for path in (".git", ".venv", ".env", "runs"):
        assert path in ignored, path


def test_the_deps_script_lists_pyproject_dependencies() -> None:
    out = subprocess.run(["python3", "docker/pyproject_deps.py", "cpu"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    assert "torch==2.13.0" in out and any(d.startswith("fastapi") for d in out)
    out = subprocess.run(["python3", "docker/pyproject_deps.py", "gpu", "torch", "vllm"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    assert not any(d.startswith(("torch", "vllm")) for d in out) and any(d.startswith("redis") for d in out)


# -- docker compose config --------------------------------------------------------------

def compose_command() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True,
                               check=False)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


COMPOSE_CMD = compose_command()
needs_compose = pytest.mark.skipif(
    COMPOSE_CMD is None,
    reason="neither `docker compose` nor `docker-compose` is installed (e.g. apt-get install docker-compose)",
)


def run_config(*args: str, token: str | None = "t0ken",
               extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "COMPOSE_"))}
    if token is not None:
        env["TANDEM_API_TOKEN"] = token
    env.update(extra or {})
    return subprocess.run([*COMPOSE_CMD, *args, "config"], check=False, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


@needs_compose
@pytest.mark.parametrize("profile", [[], ["--profile", "cpu"], ["--profile", "gpu"]])
def test_compose_config_accepts_the_file(profile: list[str]) -> None:
    result = run_config(*profile)
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    assert rendered["services"]["sampler-cpu"]["environment"]["TANDEM_API_TOKEN"] == "t0ken" or (
        "sampler-cpu" not in rendered["services"])


def published(service: dict) -> list[tuple[str, str, str]]:
    """(host ip, host port, container port) of each published port, from `config`'s output:
    the short form of docker-compose 1.x ("127.0.0.1:8100:8100/tcp") or the long form of
    `docker compose` v2 (host_ip, published, target)."""
    out = []
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            out.append((str(entry.get("host_ip", "")), str(entry["published"]), str(entry["target"])))
        else:
            host_ip, host_port, target = str(entry).split("/")[0].rsplit(":", 2)
            out.append((host_ip, host_port, target))
    return out


@needs_compose
@pytest.mark.parametrize("profile,sampler,inference", [("cpu", "sampler-cpu", "inference-cpu"),
                                                       ("gpu", "sampler", "inference")])
@pytest.mark.parametrize("bind", [None, "0.0.0.0"])
def test_compose_config_publishes_the_sampler_alone_on_loopback_unless_bound(
        profile: str, sampler: str, inference: str, bind: str | None) -> None:
    extra = {"TANDEM_SAMPLER_PORT": "9100", "TANDEM_INFERENCE_PORT": "9000"}  # the latter: read no more
    if bind:
        extra["TANDEM_BIND"] = bind
    result = run_config("--profile", profile, extra=extra)
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)["services"]
    assert published(rendered[sampler]) == [(bind or "127.0.0.1", "9100", "8100")]
    assert published(rendered[inference]) == []
    assert rendered[inference]["environment"]["TANDEM_API_TOKEN"] == "t0ken"


@needs_compose
def test_compose_config_refuses_a_missing_token_with_the_message() -> None:
    result = run_config(token=None)
    assert result.returncode != 0
    assert "set TANDEM_API_TOKEN" in result.stderr + result.stdout


@needs_compose
@pytest.mark.skipif(COMPOSE_CMD != ["docker", "compose"],
                    reason="docker-compose v1 `config` lists services of every profile")
def test_compose_profiles_select_the_stack() -> None:
    def listed(*args: str) -> set[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "COMPOSE_"))}
        env["TANDEM_API_TOKEN"] = "t0ken"
        out = subprocess.run([*COMPOSE_CMD, *args, "config", "--services"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        return set(out.split())

    assert listed() == {"redis"} | GPU  # the .env default
    assert listed("--profile", "cpu") == {"redis"} | CPU
