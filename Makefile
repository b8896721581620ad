# Two commands for a new user, on a machine with nothing but Python 3.10+:
#   make demo   create .venv, install zerofit, train the embedded demo model (2-3 minutes on 2 CPU cores)
#   make test   create .venv, install zerofit with its test tools, run the test suite
#
# The install pins torch to its CPU build through constraints-cpu.txt. On a machine
# with a CUDA build of torch, drop the pin:  make demo CONSTRAINTS=
# (or install by hand, see docs/dependencies.md).

PYTHON      ?= python3
# A guard, not the plan: the demo's 250 steps take about a minute on 2 idle cores;
# on a busy machine training stops after 90 s so that make demo stays near 3 minutes.
DEMO_ARGS   ?= --time-budget 90
PYTEST_ARGS ?= -n 2 --dist loadscope --no-loadscope-reorder
VENV        ?= .venv
CONSTRAINTS ?= constraints-cpu.txt
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.zerofit-installed
LINT_PATHS  := src tests bench examples

.PHONY: demo test lint doctor install clean

demo: $(STAMP)
	$(BIN)/zerofit train $(DEMO_ARGS)

# Two xdist workers, one per core of the CI machine; each test module runs whole on one worker (its module
# fixtures once), in the order of pyproject.toml's testpaths. make test PYTEST_ARGS= runs in one process.
test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The gates every change passes before its tests (pyproject.toml's [tool.ruff] and [tool.mypy]).
lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy

doctor: $(STAMP)
	$(BIN)/zerofit doctor

install: $(STAMP)

# Reinstalled only when the project's dependencies or pins change; the package
# itself is installed editable, so source edits need no reinstall.
# DS_BUILD_OPS=0: the test extra's DeepSpeed (an sdist) installs as Python only, no compiled ops.
# --no-compile: byte-compiling all of torch and transformers at install takes ~40 s
# on 2 cores; Python compiles the few modules it imports on first use instead.
$(STAMP): pyproject.toml $(wildcard $(CONSTRAINTS))
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q --no-compile $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '.[test]'
	touch $@

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
