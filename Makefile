# The two commands, on a machine with only python3 and make:
#     make train     # train the debug model on the built-in corpus, then sample from its export
#     make test      # the test suite (what CI runs)
# Both create $(VENV) and install into it on first use; later runs skip the installs until
# pyproject.toml changes (the stamp file below is older than it). After a run, `make sample`
# and `make plot` (same CONFIG and ARGS) sample from its export and draw its metrics.
# `make help` lists the targets.

PYTHON      ?= python3
VENV        ?= .venv
CONFIG      ?= train_configs/debug_model.toml
ARGS        ?=
PYTEST_ARGS ?=
empty       :=
PROMPT      ?= def$(empty) $(empty)
SAMPLE_ARGS ?= --max_new_bytes 100
# torch is installed only when the venv cannot import it, so an existing build (a CUDA torch,
# say) is left alone. Pinned because an unpinned torch resolves to the newest CUDA build, several
# GB: on this project's machines torch==2.13.0 is a CPU wheel on local disk; elsewhere, without
# an NVIDIA GPU, add PyTorch's CPU package index to TORCH_PIP_ARGS for the CPU build.
TORCH          ?= torch==2.13.0
TORCH_PIP_ARGS ?=

VPY   := $(VENV)/bin/python
STAMP := $(VENV)/.spider_titan_installed

.PHONY: help install train sample plot test test-fast lint gpu

help:
	@echo "make train    train CONFIG ($(CONFIG)) with the overrides in ARGS,"
	@echo "              then print a sample from its export"
	@echo "make sample   sample from the export of CONFIG/ARGS's run (PROMPT, SAMPLE_ARGS)"
	@echo "make plot     draw CONFIG/ARGS's run's metrics.jsonl into <run folder>/metrics.png"
	@echo "make test     run the tests (python -m pytest -q -n TEST_WORKERS PYTEST_ARGS), as CI does"
	@echo "make test-fast  tests/ without those marked slow: every package module, in minutes (same options)"
	@echo "make lint     ruff check and ruff format --check (CI runs both; ruff format . fixes the format)"
	@echo "make install  create VENV and install torch and the project (train and test do it first)"
	@echo "make gpu      on a lent GPU machine: the prepared call of lab/device/ (OUT: where its table goes)"
	@echo "make help     this list"
	@echo ""
	@echo "variables (make VAR=value ...), now:"
	@echo "  PYTHON=$(PYTHON)  VENV=$(VENV)  CONFIG=$(CONFIG)"
	@echo "  ARGS='$(ARGS)'  (--section.key value overrides for train; see: $(VPY) -m spider_titan.train --help)"
	@echo "  PROMPT='$(PROMPT)'  SAMPLE_ARGS='$(SAMPLE_ARGS)'  (see: $(VPY) scripts/generate.py --help)"
	@echo "  PYTEST_ARGS='$(PYTEST_ARGS)'  TORCH='$(TORCH)'  TORCH_PIP_ARGS='$(TORCH_PIP_ARGS)'"
	@echo ""
	@echo "example: make train ARGS='--training.steps 50 --model.n_loops 3'"

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(VPY)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "$(TORCH)" $(TORCH_PIP_ARGS)
	$(VPY) -m pip install -q -e ".[test]"
	touch $@

install: $(STAMP)

# The run folder (job.dump_folder) that CONFIG and ARGS resolve to, as the trainer's own parser
# reads them; a recipe line that uses it starts with `dump=$(RUN_FOLDER) &&`, so a config error
# (printed as the trainer prints it, one line per problem) stops the recipe there.
RUN_FOLDER = "$$($(VPY) -c 'import sys; from spider_titan.config.manager import parse_args; \
	sys.excepthook = lambda t, e, tb: print(*(f"config error: {p}" for p in getattr(e, "problems", [e])), \
	sep="\n", file=sys.stderr); print(parse_args(sys.argv[1:]).job.dump_folder)' \
	--job.config_file $(CONFIG) $(ARGS))"

# Sample from <run folder>/export, under a line that says what it is.
define sample_recipe
	@dump=$(RUN_FOLDER) && echo "sample from $$dump/export (prompt '$(PROMPT)'):" && \
	    $(VPY) scripts/generate.py --model "$$dump/export" --prompt '$(PROMPT)' $(SAMPLE_ARGS)
endef

train: $(STAMP)
	$(VPY) -m spider_titan.train --job.config_file $(CONFIG) $(ARGS)
	$(sample_recipe)

sample: $(STAMP)
	$(sample_recipe)

plot: $(STAMP)
	@dump=$(RUN_FOLDER) && $(VPY) scripts/plot.py "$$dump"

# The venv's bin first on PATH: tests and scripts that start `python` get the venv's.
# Two pytest-xdist workers: most tests wait on a subprocess or run one thread, so two cores finish the
# suite in about 2/3 of the serial time; work stealing keeps the long compile tests from ending last on one worker.
TEST_WORKERS ?= 2
test: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

# The fast lane, for a developer between edits: the product's tests (tests/) not marked slow (those
# start processes: trainers, torchrun, scripts; or compile). tests/unit/test_fast_lane.py holds that
# it still imports every module of the package; `make test` (CI) runs everything, lab/tests too.
test-fast: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow" tests $(PYTEST_ARGS)

# Lint and format check, as CI runs them (the pinned ruff of the test extra, pyproject.toml [tool.ruff]).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The prepared call for a lent GPU (lab/device/README.md): no venv there, the machine's python3 and this
# checkout on PYTHONPATH; the carried corpus in outputs/device_corpus, the table and JSON under OUT.
OUT      ?= outputs/third_scale
GPU_ARGS ?=
gpu:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" PYTHONUNBUFFERED=1 $(PYTHON) -m lab.device.third_scale --out "$(OUT)" $(GPU_ARGS)
