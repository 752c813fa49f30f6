# Two commands on a fresh machine:  `make report` (the investigations) and `make test` (the test suite).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch 2.13.0, the version the suite runs with, from pip's index like every other dependency. On Linux, PyPI's
# torch 2.13.0 is the CUDA 13 build (several GB; it runs on a CPU too). For the CPU-only build (a few hundred MB),
# opt in to PyTorch's CPU index:  make report TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=

.PHONY: report test test-fast benchmarks browser-deps clean

report: $(VENV)/.installed
	$(BIN)/python -m exlnb.report

# Two worker processes (pytest-xdist), fewer on a machine of fewer cores. Each takes whole test files (a file's
# JupyterLab, notebook run or kernel is started once), the files with slow tests first (tests/conftest.py).
PARALLEL := -n logical --maxprocesses=2 --dist loadfile --no-loadscope-reorder

test: $(VENV)/.installed-test browser-deps
	$(BIN)/python -m ruff check . && $(BIN)/python -m ruff format --check .
	$(BIN)/python -m pytest $(PARALLEL) --durations=20

# The edit loop: everything but the tests marked slow (notebooks, browser, kernels, servers) and gpu.
test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest $(PARALLEL) -m 'not slow and not gpu' --durations=10

benchmarks: $(VENV)/.installed
	$(BIN)/python -m benchmarks

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e .
	touch $@

# llama-cpp-python, the llama.cpp test server (tests/servers.py), has no wheel on PyPI: pip builds it. It is built
# portable, not for this CPU: ggml's default, -march=native, emits AMX tile instructions on an Intel host whose CPU
# reports AMX, and there the server died with SIGILL on its first generation (three starts of three); built on an
# AVX-512 CPU, it emits AVX-512 that other CPUs lack. With GGML_NATIVE=OFF, ggml 0.25.3 (llama-cpp-python 0.3.36)
# targets SSE4.2, AVX, AVX2, BMI2, FMA and F16C, no AVX-512, no AMX. The tests never load the multimodal library
# (LLAVA_BUILD=OFF) nor llama.cpp's common library (tests/llama_cpp_no_common.cmake says how it is left out).
# --no-cache-dir: pip's cache keys a wheel it built by the sdist alone, not by CMAKE_ARGS, so a native build made
# earlier on this machine would be installed as it is.
LLAMA_CPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF \
	-DCMAKE_PROJECT_llama.cpp_INCLUDE=$(CURDIR)/tests/llama_cpp_no_common.cmake

$(VENV)/.installed-test: $(VENV)/.installed
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(BIN)/python -m pip install -q --no-cache-dir --no-binary llama-cpp-python \
		-e '.[test]'
	touch $@

# The browser test drives JupyterLab in Debian's Chromium; without root or apt it is skipped, and says so.
browser-deps:
	@test -x /usr/bin/chromium || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		echo "no /usr/bin/chromium and no way to install it here: the browser test will be skipped"

clean:
	rm -rf $(VENV) reports test-artifacts
