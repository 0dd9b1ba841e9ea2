"""Print pyproject.toml's dependencies (plus extras) one per line, for `pip install -r`.

    python docker/pyproject_deps.py EXTRAS [SKIP...]
    python docker/pyproject_deps.py cpu               # dependencies + the cpu extra
    python docker/pyproject_deps.py gpu torch vllm    # + gpu extra, minus torch and vllm

Used by docker/Dockerfile to install the dependency layer from pyproject.toml alone
(so that editing the source does not reinstall them). SKIP names packages the base
image already provides, such as the vLLM image's own CUDA torch.
"""

import re
import sys
import tomllib


def main(argv: list[str]) -> int:
    extras = [x for x in (argv[0] if argv else "").split(",") if x]
    skip = {name.lower() for name in argv[1:]}
    with open("pyproject.toml", "rb") as fh:
        project = tomllib.load(fh)["project"]
    deps = list(project["dependencies"])
    for extra in extras:
        if extra not in project.get("optional-dependencies", {}):
            print(f"pyproject.toml has no extra {extra!r}", file=sys.stderr)
            return 2
        deps += project["optional-dependencies"][extra]
    for dep in deps:
        name = re.split(r"[\s<>=!~\[;]", dep, maxsplit=1)[0].lower()
        if name not in skip:
            print(dep)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
