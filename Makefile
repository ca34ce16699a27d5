# The two commands, on a machine with only python3 and make:
#     make train     # train the debug model on the built-in corpus, then sample from its export
#     make test      # the test suite (what CI runs)
# Both create $(VENV) and install into it on first use; later runs skip the installs until
# pyproject.toml changes (the stamp file below is older than it). `make help` lists the targets.

PYTHON      ?= python3
VENV        ?= .venv
CONFIG      ?= train_configs/debug_model.toml
ARGS        ?=
PYTEST_ARGS ?=
# torch is installed only when the venv cannot import it, so an existing build (a CUDA torch,
# say) is left alone. Pinned because an unpinned torch resolves to the newest CUDA build, several
# GB: on this project's machines torch==2.13.0 is a CPU wheel on local disk; elsewhere, without
# an NVIDIA GPU, add PyTorch's CPU package index to TORCH_PIP_ARGS for the CPU build.
TORCH          ?= torch==2.13.0
TORCH_PIP_ARGS ?=

VPY   := $(VENV)/bin/python
STAMP := $(VENV)/.spider_titan_installed

.PHONY: help install train test

help:
	@echo "make train    train CONFIG ($(CONFIG)) with the overrides in ARGS,"
	@echo "              then print a sample from its export"
	@echo "make test     run the tests (python -m pytest -q PYTEST_ARGS), as CI does"
	@echo "make install  create VENV and install torch and the project (train and test do it first)"
	@echo "make help     this list"
	@echo ""
	@echo "variables (make VAR=value ...), now:"
	@echo "  PYTHON=$(PYTHON)  VENV=$(VENV)  CONFIG=$(CONFIG)"
	@echo "  ARGS='$(ARGS)'  (--section.key value overrides for train; see: $(VPY) -m spider_titan.train --help)"
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

# The sample is read from <dump_folder>/export, the folder as resolved by CONFIG and ARGS.
train: $(STAMP)
	$(VPY) -m spider_titan.train --job.config_file $(CONFIG) $(ARGS)
	$(VPY) scripts/generate.py --prompt "def " --max_new_bytes 100 --model "$$($(VPY) -c \
	    'import sys; from spider_titan.config.manager import parse_args; print(parse_args(sys.argv[1:]).job.dump_folder)' \
	    --job.config_file $(CONFIG) $(ARGS))/export"

# The venv's bin first on PATH: tests and scripts that start `python` get the venv's.
test: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VPY) -m pytest -q $(PYTEST_ARGS)
