# The two commands: `make run` (execute the course) and `make test`.
# Each builds .venv from nothing on a fresh clone, and again when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: run test test-fast lab lint format strip gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install -e ".[dev]"
	touch $(STAMP)

run: $(STAMP)  ## execute every notebook into build/ (ipynb + HTML) and print a table
	$(BIN)/ddp-tutorial course --output-dir build

test: $(STAMP)  ## lint + the whole pytest suite (unit, torchrun, notebooks)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)  ## the edit loop: lint + every test that starts no torchrun and no notebook
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -m "not torchrun and not notebook" $(PYTEST_ARGS)

lab: $(STAMP)  ## JupyterLab on notebooks/ (token auth stays on)
	$(BIN)/jupyter lab notebooks/

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

strip: $(STAMP)  ## remove notebook outputs before committing
	$(BIN)/ddp-tutorial strip

# On a GPU machine with torch, pytest, psutil, nvidia-ml-py, matplotlib and tqdm
# but no pip: no venv, the package from the source tree.
gpu-check:
	PYTHONPATH=. $(PYTHON) -m pytest -m gpu -p no:cacheprovider -o addopts="" tests
	PYTHONPATH=. $(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 1 \
		scripts/hello.py --backend nccl

clean:
	rm -rf build runs notebooks/runs .pytest_cache
