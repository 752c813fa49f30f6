# Two commands on a fresh machine:  `make report` (the investigations) and `make test` (the test suite).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: report test benchmarks browser-deps clean

report: $(VENV)/.installed
	$(BIN)/python -m exlnb.report

test: $(VENV)/.installed-test browser-deps
	$(BIN)/python -m pytest

benchmarks: $(VENV)/.installed
	$(BIN)/python -m benchmarks

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Without CUDA, take torch 2.13.0 (a CPU build here): an unpinned torch pulls a multi-GB CUDA build.
	command -v nvidia-smi >/dev/null 2>&1 || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

# The browser test drives JupyterLab in Debian's Chromium; without root or apt it is skipped, and says so.
browser-deps:
	@test -x /usr/bin/chromium || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "no /usr/bin/chromium and no way to install it here: the browser test will be skipped"

clean:
	rm -rf $(VENV) reports test-artifacts
