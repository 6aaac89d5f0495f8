# Two commands do everything on a fresh clone:
#   make lab    set up, then start JupyterLab on notebooks/ (loopback only)
#   make test   set up, then run the unit tests and execute every notebook (nbval and papermill)
# and one for the inner loop:
#   make test-fast   the tests that start no lesson, browser, crash matrix or benchmark (-m "not slow")

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8888
# The tests spend much of their time waiting on child processes (kernels, workers, servers), so
# they run in more pytest-xdist workers than there are cores (four keep both of two cores busy). `--dist loadgroup`: the cells of one notebook, and the tests that share a module-scoped
# fixture (a server), stay in one worker; tests/conftest.py sets the groups and hands out the
# longest first. Each worker has its own labs, ports and temporary folders.
# `make test PYTEST_WORKERS=0` runs serially.
PYTEST_WORKERS ?= 4
PARALLEL := -n $(PYTEST_WORKERS) --dist loadgroup
# `python3`: under `make test`, the tests' own kernel spec (tests/conftest.py), whose kernels are
# forked from the fork server (sophos_lab/lab/kernels.py); elsewhere this venv's ipykernel.
NBVAL_OPTIONS := --nbval-lax --nbval-kernel-name=python3 --nbval-cell-timeout=120 \
	--nbval-kernel-startup-timeout=120 --nbval-sanitize-with tests/notebooks/sanitize.cfg
# The lessons are committed without outputs; nbval runs on copies with the golden outputs of their
# checked cells put back (tests/notebooks/golden/, see tests/notebooks/golden.py).
NBVAL_COPIES := .lab/nbval

.PHONY: setup lab test test-fast test-unit test-matrix test-notebooks record-golden bench benchmark soak reset clean

# The three installs are independent: side by side (-j3), set-up takes about as long as the
# largest, the kit's venv. uv installs the venvs (11 s here where pip took 48 s, the same
# versions); where uv cannot reach an index that only pip is configured for, pip does it.
setup:
	@$(MAKE) -s --no-print-directory -j3 $(VENV)/.installed node_modules/.installed .tools/fetch/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check uv
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[test]' \
		|| $(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
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
	.tools/fetch/bin/pip install --quiet --disable-pip-version-check uv
	.tools/fetch/bin/uv pip install --quiet --compile-bytecode --python .tools/fetch/bin/python "mcp-server-fetch==2026.10.10" \
		|| .tools/fetch/bin/pip install --quiet "mcp-server-fetch==2026.10.10"
	touch $@

# `make lab PORT=8890` for another port (PORT=0: any free one). The last line it prints is the URL
# to open, with the login token; JupyterLab keeps its settings and workspaces in .lab/jupyter/.
lab: setup
	$(BIN)/sophos-lab lab --port $(PORT)

# Kernels started by the tests keep their IPython profile and connection files in .lab/.
test test-fast test-unit test-matrix test-notebooks record-golden: export IPYTHONDIR := $(CURDIR)/.lab/ipython
test test-fast test-unit test-matrix test-notebooks record-golden: export JUPYTER_RUNTIME_DIR := $(CURDIR)/.lab/jupyter-runtime

# One pytest session for the tests and nbval's lessons, so that the workers share out both.
test: setup
	$(BIN)/python tests/notebooks/golden.py inject $(NBVAL_COPIES)
	$(BIN)/pytest -q $(PARALLEL) --durations=25 -m "not full_matrix" $(NBVAL_OPTIONS) tests $(NBVAL_COPIES)

# Every crash matrix, each signal and scenario, the load tests and every lesson against the
# second Ollama-protocol server (`make test` leaves out those marked full_matrix).
test-matrix: setup
	$(BIN)/pytest -p no:nbval -q $(PARALLEL) -m "crash_matrix or full_matrix" --every-point tests

test-fast: setup
	$(BIN)/pytest -p no:nbval -q $(PARALLEL) -m "not slow" tests

test-unit: setup
	$(BIN)/pytest -p no:nbval -q $(PARALLEL) tests

# Without tests/conftest.py (it sets the groups) one notebook's cells stay together by file.
test-notebooks: setup
	$(BIN)/python tests/notebooks/golden.py inject $(NBVAL_COPIES)
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(NBVAL_OPTIONS) -p no:python $(NBVAL_COPIES)

# After a checked output changed on purpose: `make record-golden` (all lessons) or
# `make record-golden LESSONS="07_side_effects_and_idempotency"`; then review the diff of tests/notebooks/golden/.
record-golden: setup
	$(BIN)/python tests/notebooks/golden.py record $(LESSONS)

# Every benchmark in one table (benchmarks/bench.py): per step, storage growth, listing at scale,
# child start-up, kill -> resume, the SSE stream, the retry waits. `make bench BENCH_FLAGS=--quick` for a smoke run.
bench: setup
	$(BIN)/python benchmarks/bench.py $(BENCH_FLAGS)

benchmark: bench

# The chaos soak (tests/soak.py, not collected by pytest): users load two web servers and two workers
# on a PostgreSQL of its own while servers, workers and the postmaster are killed at random; then
# every message, payment, stream and process is checked. One summary line, PASS or FAIL (exit 1).
# `make soak SOAK_ARGS="--seed 7 --minutes 1"` (defaults: 3 minutes, a random seed, printed).
soak: setup
	$(BIN)/python tests/soak.py $(SOAK_ARGS)

reset:
	rm -rf .lab

clean: reset
	rm -rf $(VENV) node_modules .tools .pytest_cache
