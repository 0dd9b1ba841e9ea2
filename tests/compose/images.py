"""The images the CPU stack runs, built on a machine that may reach no image registry.

* Our image (`tandem:cpu`) is built from docker/Dockerfile exactly as docker-compose.yml's
  `build:` says (context, dockerfile, target and tag are read from the compose file), with
  `--network host` (the private daemon has no NAT bridge for build containers).
* When the registry's `python:3.11-slim` cannot be pulled, the base is a Debian bookworm
  rootfs made by debootstrap (cached, made once) and `docker import`ed; it gets the host's
  CA bundle, which pip needs where TLS is intercepted (PIP_CERT points at it in the build).
* When download.pytorch.org is unreachable, torch comes from PyPI, and the CPU wheel from the
  host's pip find-links directory (served over HTTP for the build) when it has one.
* When `redis:7.4-alpine` cannot be pulled, that tag is given to the bookworm base with
  Debian's redis-server (WORKDIR /data like the official image, where the AOF then lands on
  the compose file's `redis-data` volume). Only ever in a daemon that could not pull it.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from tests.compose.engine import Engine, Skip

REPO = Path(__file__).resolve().parents[2]
BASE_TAG = "tandem-compose-base:bookworm"
DEBOOTSTRAP = ["debootstrap", "--variant=minbase",
               "--include=python3,python3-venv,python3-pip,ca-certificates,redis-server", "bookworm"]
STAND_IN_LABEL = "tandem.compose-check.stand-in"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")


def _has_image(engine: Engine, tag: str) -> bool:
    return engine.docker("image", "inspect", tag, check=False).returncode == 0


def _pull(engine: Engine, tag: str) -> bool:
    return _has_image(engine, tag) or engine.docker("pull", tag, check=False, timeout=600).returncode == 0


def local_base(engine: Engine, cache: Path) -> str:
    """BASE_TAG, imported from a debootstrap rootfs (made once under `cache`)."""
    if _has_image(engine, BASE_TAG):
        return BASE_TAG
    rootfs = cache / "bookworm"
    if not (rootfs / ".complete").exists():
        if shutil.which("debootstrap") is None:
            raise Skip("the registry's base images cannot be pulled and debootstrap, which would make a "
                       "local one, is not installed (apt-get install debootstrap)")
        subprocess.run(["rm", "-rf", str(rootfs)], check=True)
        print(f"  debootstrap bookworm into {rootfs} (once; about a minute)", flush=True)
        subprocess.run([*DEBOOTSTRAP, str(rootfs)], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["sh", "-c", f"rm -rf {rootfs}/var/cache/apt/archives/*.deb {rootfs}/var/lib/apt/lists/*"],
                       check=True)
        (rootfs / ".complete").touch()
    if HOST_CA.exists():
        (rootfs / "etc/ssl/certs/ca-certificates.crt").write_bytes(HOST_CA.read_bytes())
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--exclude", "./.complete", "-c", "."],
                           stdout=subprocess.PIPE)
    engine.docker("import", "--change", "ENV LANG=C.UTF-8", "-", BASE_TAG, stdin=tar.stdout, timeout=600)
    tar.wait()
    return BASE_TAG


def ensure_redis(engine: Engine, tag: str, cache: Path) -> str:
    """`tag` (the compose file's Redis image) pulled, or stood in for by Debian's redis-server."""
    labels = engine.docker("image", "inspect", "-f", "{{json .Config.Labels}}", tag, check=False).stdout
    if STAND_IN_LABEL not in labels and _pull(engine, tag):  # a stand-in is rebuilt (cached): it may have changed
        return "pulled"
    base = local_base(engine, cache)
    # The official image's entrypoint adds `--protected-mode no` to a redis-server started
    # without a config file (else only loopback clients are served); so does this one.
    dockerfile = (f"FROM {base}\nWORKDIR /data\nEXPOSE 6379\nLABEL {STAND_IN_LABEL}=1\n"
                  'ENTRYPOINT ["sh", "-c", "if [ \\"$1\\" = redis-server ]; then exec \\"$@\\" --protected-mode no; '
                  'else exec \\"$@\\"; fi", "--"]\n'
                  'CMD ["redis-server"]\n')
    engine.docker("build", "-t", tag, "-", input=dockerfile, timeout=300)
    return f"stand-in: {base} + Debian's redis-server, tagged {tag}"


def _reaches(url: str) -> bool:
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=8)
        return True
    except OSError:
        return False


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


class WheelServer:
    """Serves a directory of wheels on 127.0.0.1 for `pip --find-links` inside a build."""

    # A fixed port when free: the URL is a build arg, part of the RUN steps' cache key, so a
    # new port each run would reinstall torch and every dependency layer after it.
    PORT = 47613

    def __init__(self, directory: Path):
        handler = functools.partial(_QuietHandler, directory=str(directory))
        try:
            self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", self.PORT), handler)
        except OSError:
            self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _host_torch_wheel_dir() -> Path | None:
    """The host pip's find-links directory when it holds a CPU torch 2.13.0 wheel."""
    out = subprocess.run(["python3", "-m", "pip", "config", "get", "global.find-links"], capture_output=True,
                         text=True, check=False).stdout.strip()
    for d in out.split():
        if Path(d).is_dir() and any(Path(d).glob("torch-2.13.0+cpu-*.whl")):
            return Path(d)
    return None


def compose_build(image: str) -> dict:
    """The compose file's `build:` for the service whose image is `image`."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    for spec in compose["services"].values():
        if spec.get("image") == image and "build" in spec:
            return spec["build"]
    raise KeyError(f"no service in docker-compose.yml builds {image}")


class Builder:
    """`docker build` of the compose file's images with the build args this machine needs
    (decided once: the same args give the same layer cache keys for every target)."""

    def __init__(self, engine: Engine, cache: Path):
        self.engine, self.args, self.notes, self.server = engine, {}, [], None
        if not _pull(engine, "python:3.11-slim"):
            self.args["PYTHON_IMAGE"] = local_base(engine, cache)
            self.args["PIP_CERT"] = "/etc/ssl/certs/ca-certificates.crt"  # the host's bundle, copied in
            self.notes.append(f"python:3.11-slim cannot be pulled: base {self.args['PYTHON_IMAGE']} "
                              "(debootstrap bookworm)")
        if not _reaches("https://download.pytorch.org/whl/cpu/"):
            self.args["TORCH_INDEX_URL"] = "https://pypi.org/simple"
            wheels = _host_torch_wheel_dir()
            if wheels is not None:
                self.server = WheelServer(wheels)
                self.args["PIP_FIND_LINKS"] = self.server.url
            self.notes.append("download.pytorch.org is unreachable: torch from PyPI"
                              + (f", the CPU wheel from {wheels}" if wheels else " (the CUDA build: large)"))

    def build(self, image: str, tag: str | None = None, **extra: str) -> float:
        """Builds `image` as the compose file's `build:` says (as `tag`); the seconds it took."""
        build = compose_build(image)
        cmd = ["build", "--network", "host", "-t", tag or image, "-f", str(REPO / build["dockerfile"]),
               "--target", build["target"]]
        for key, value in {**self.args, **extra}.items():
            cmd += ["--build-arg", f"{key}={value}"]
        started = time.monotonic()
        result = self.engine.docker(*cmd, str(REPO / build.get("context", ".")), check=False, timeout=1800)
        if result.returncode != 0:
            raise RuntimeError(f"building {image} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
        return time.monotonic() - started

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def build_ours(builder: Builder, image: str = "tandem:cpu") -> list[str]:
    seconds = builder.build(image)
    if builder.engine.private:
        # The images an earlier run's build left untagged: the private data root is kept
        # between runs and would otherwise grow by a full image per dependency change.
        builder.engine.docker("image", "prune", "-f", check=False)
    return [*builder.notes, f"built {image} in {seconds:.0f} s"]


def build_gpu_steps(builder: Builder, stand_in: str = "tandem:cpu") -> list[str]:
    """The gpu target's build steps on `stand_in` in place of the vLLM image, which cannot be
    pulled here (and is CUDA-only): pyproject_deps.py's list minus torch and vllm installed,
    our package installed, the CLI run. The result is tagged tandem:gpu-steps, never tandem:gpu."""
    tag = "tandem:gpu-steps"
    seconds = builder.build("tandem:gpu", tag=tag, VLLM_IMAGE=stand_in)
    # The list the gpu target installs (docker/Dockerfile: the gpu extra and the tracking extras).
    listed = builder.engine.docker("run", "--rm", "--entrypoint", "python3", tag, "pyproject_deps.py",
                                   "gpu,wandb,tensorboard", "torch", "vllm").stdout.split()
    assert listed and not any(d.startswith(("torch", "vllm")) for d in listed), listed
    builder.engine.docker("image", "rm", tag, check=False)
    return [f"gpu target's steps built on {stand_in} in {seconds:.0f} s (vllm/vllm-openai cannot be pulled "
            f"here): {len(listed)} requirements installed, tandem --help runs"]
