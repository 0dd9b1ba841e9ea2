"""verifiers environments: the test tasksets and harnesses under plugins/, and the example
under examples/verifiers/, are importable by id (verifiers imports `tandem-vf-parity` as the
module `tandem_vf_parity`), in this process and in the tool servers verifiers starts as
subprocesses (PYTHONPATH)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PLUGINS = Path(__file__).parent / "plugins"
EXAMPLES = Path(__file__).parents[2] / "examples" / "verifiers"


@pytest.fixture(scope="package", autouse=True)
def vf_plugins() -> Iterator[Path]:
    dirs = [str(PLUGINS), str(EXAMPLES)]
    sys.path[:0] = dirs
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (*dirs, str(Path.cwd()), before) if p)
    yield PLUGINS
    for directory in dirs:
        sys.path.remove(directory)
    if before is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = before


@pytest.fixture(scope="session")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.byte_tokenizer import save_byte_tokenizer

    return save_byte_tokenizer(tmp_path_factory.mktemp("byte-tokenizer"))
