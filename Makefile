# The two commands: `make run` (execute the course) and `make test`.
# Each builds .venv from nothing on a fresh clone, and again when pyproject.toml changes.
PYTHON ?= python3
# GPU machines: a torch that $(PYTHON) can already import (an NGC-style container, a conda
# env with the CUDA build) is kept: the venv then sees the system site-packages and pip
# reuses it. Or pick the CUDA build for the first install: make run TORCH_INDEX=<index URL>.
TORCH_INDEX ?=
SYSTEM_TORCH := $(shell $(PYTHON) -c "import importlib.util as u, sys; sys.exit(not u.find_spec('torch'))" 2>/dev/null && echo yes)
# ... and pinned: without the pin, pip would replace it by a download whenever torchvision
# is missing or too old for it (torchvision 0.29 needs torch >= 2.14). A torch older than
# the course's torch>=2.14 then fails the install with pip's conflict, instead of a swap.
SYSTEM_TORCH_VERSION := $(if $(SYSTEM_TORCH),$(shell $(PYTHON) -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null))
VENV := .venv
CONSTRAINTS := $(VENV)/constraints.txt
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# make test's pytest-xdist workers: the suite waits more than it computes (tests/conftest.py
# says how its groups are spread); 0 runs it in this one process.
TEST_WORKERS ?= 2

.PHONY: run test test-fast rehearse lab format strip gpu-check gpu-smoke floor-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(if $(SYSTEM_TORCH),--system-site-packages) $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(if $(TORCH_INDEX),$(BIN)/python -m pip install --index-url $(TORCH_INDEX) torch torchvision)
	$(if $(SYSTEM_TORCH_VERSION),echo "torch==$(SYSTEM_TORCH_VERSION)" > $(CONSTRAINTS))
	$(BIN)/python -m pip install $(if $(SYSTEM_TORCH_VERSION),-c $(CONSTRAINTS)) -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)  ## execute every notebook into build/ (ipynb + HTML) and print a table
	$(BIN)/ddp-tutorial course --output-dir build

test: $(STAMP)  ## lint + the whole pytest suite (unit, torchrun, notebooks)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

test-fast: $(STAMP)  ## the edit loop: lint + every test that starts no torchrun, no notebook and needs no GPU
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -m "not torchrun and not notebook and not gpu" $(PYTEST_ARGS)

rehearse: $(STAMP)  ## the lessons at GPU world sizes (3 and 8 gloo ranks) on this CPU, a table
	$(BIN)/python -m ddp_tutorial.harness.rehearse --ranks 3 8

lab: $(STAMP)  ## JupyterLab on notebooks/ (token auth stays on; as root, as in most GPU containers)
	$(BIN)/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

strip: $(STAMP)  ## remove notebook outputs before committing
	$(BIN)/ddp-tutorial strip

# On a GPU machine with torch, pytest, psutil, nvidia-ml-py, matplotlib and tqdm but no pip
# and no Jupyter (it says what is missing first; without torchvision, lessons 04 and 06, whose
# resnet18 needs it, are rows "not run"): no venv, the package from the source tree. The gpu
# tests, an nccl hello across every GPU, lessons 03-06 and 08-12 run without Jupyter; a table.
gpu-check:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m ddp_tutorial.harness.gpu_check

# The 8-minute version for a first GPU (one is enough): versions, MIG and compute mode, the
# one-GPU gpu tests, lesson 11's script, lesson 06's utilization, lesson 12's memory, two
# deterministic template runs compared bitwise. Everything it measures lands in $(OUT) if set,
# else build/gpu-smoke/ (smoke.json, smoke.txt, a log per step). Without a GPU the GPU steps are
# rows "not run: no GPU"; SMOKE_ARGS=--cpu also runs there the steps a CPU can.
gpu-smoke:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m ddp_tutorial.harness.gpu_smoke $(SMOKE_ARGS)

# The template's own floor (train.py: "torch 2.10 or later"), which make test cannot run: a venv
# with that torch, then every torch name of the copied files checked against it and the tests
# of the copied template run on it. Needs pip's network; FLOOR_INDEX= for PyPI's CUDA wheel.
FLOOR_TORCH ?= 2.10.0
FLOOR_TORCHVISION ?= 0.25.0
FLOOR_INDEX ?= https://download.pytorch.org/whl/cpu
floor-check:  ## the template on the oldest torch it promises (a venv of its own, .venv-floor)
	$(PYTHON) -m venv .venv-floor
	.venv-floor/bin/python -m pip install --quiet $(if $(FLOOR_INDEX),--index-url $(FLOOR_INDEX) \
		--extra-index-url https://pypi.org/simple) torch==$(FLOOR_TORCH) torchvision==$(FLOOR_TORCHVISION)
	.venv-floor/bin/python -m pip install --quiet numpy tqdm tensorboard psutil pytest pytest-timeout
	.venv-floor/bin/python -m pip install --quiet --no-deps -e .
	.venv-floor/bin/python tests/test_torch_floor.py --check template
	.venv-floor/bin/python -m pytest -p no:cacheprovider tests/test_template_copy.py

clean:
	rm -rf build runs notebooks/runs .pytest_cache .venv-floor
