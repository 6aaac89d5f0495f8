# Two commands do everything on a fresh clone:
#   make lab    set up, then start JupyterLab on notebooks/ (loopback only)
#   make test   set up, then run the unit tests and execute every notebook (nbval and papermill)

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8888
NBVAL_FLAGS := --nbval-lax --nbval-current-env --nbval-cell-timeout=120 \
	--nbval-kernel-startup-timeout=120 --nbval-sanitize-with tests/notebooks/sanitize.cfg -p no:python
# The lessons are committed without outputs; nbval runs on copies with the golden outputs of their
# checked cells put back (tests/notebooks/golden/, see tests/notebooks/golden.py).
NBVAL_COPIES := .lab/nbval
define run_nbval
	$(BIN)/python tests/notebooks/golden.py inject $(NBVAL_COPIES)
	$(BIN)/pytest $(NBVAL_FLAGS) $(NBVAL_COPIES)
endef

.PHONY: setup lab test test-unit test-notebooks record-golden bench benchmark reset clean

setup: $(VENV)/.installed node_modules/.installed .tools/fetch/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	# jupyter-events asks for jsonschema[format-nongpl], which brings rfc3987-syntax; importing it
	# builds a grammar (1.3-2.4 s) in every process that imports the MCP client, so in every agent
	# child. Nothing needs it: jsonschema skips the IRI format checks without it.
	$(BIN)/pip uninstall --quiet --yes rfc3987-syntax
	touch $@

node_modules/.installed: package.json
	npm install --no-audit --no-fund --no-package-lock --loglevel=error
	touch $@

# The fetch MCP server in a venv of its own starts in about 1 s instead of 4 (see sophos_lab/runtime/tools.py).
.tools/fetch/.installed: pyproject.toml
	$(PYTHON) -m venv .tools/fetch
	.tools/fetch/bin/pip install --quiet "mcp-server-fetch==2026.10.10"
	touch $@

# `make lab PORT=8890` for another port (PORT=0: any free one). The last line it prints is the URL
# to open, with the login token; JupyterLab keeps its settings and workspaces in .lab/jupyter/.
lab: setup
	$(BIN)/sophos-lab lab --port $(PORT)

# Kernels started by the tests keep their IPython profile and connection files in .lab/.
test test-unit test-notebooks record-golden: export IPYTHONDIR := $(CURDIR)/.lab/ipython
test test-unit test-notebooks record-golden: export JUPYTER_RUNTIME_DIR := $(CURDIR)/.lab/jupyter-runtime

test: setup
	$(BIN)/pytest -p no:nbval tests
	$(run_nbval)

test-unit: setup
	$(BIN)/pytest -p no:nbval tests

test-notebooks: setup
	$(run_nbval)

# After a checked output changed on purpose: `make record-golden` (all lessons) or
# `make record-golden LESSONS="07_side_effects_and_idempotency"`; then review the diff of tests/notebooks/golden/.
record-golden: setup
	$(BIN)/python tests/notebooks/golden.py record $(LESSONS)

# Every benchmark in one table (benchmarks/bench.py): per step, storage growth, listing at scale,
# child start-up, kill -> resume, the SSE stream, the retry waits. `make bench BENCH_FLAGS=--quick` for a smoke run.
bench: setup
	$(BIN)/python benchmarks/bench.py $(BENCH_FLAGS)

benchmark: bench

reset:
	rm -rf .lab

clean: reset
	rm -rf $(VENV) node_modules .tools .pytest_cache
