# Two commands set up everything: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench lint clean test-tools

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU build; an unpinned resolve would pull CUDA wheels.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[cpu,dev]'
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

test: $(STAMP) test-tools
	$(PY) -m pytest -q $(ARGS)

bench: $(STAMP)
	$(PY) -m bench $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check shared services tests bench

clean:
	rm -rf $(VENV) runs .pytest_cache
