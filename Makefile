# Two commands on a fresh machine:  `make demo` (the main job) and `make test` (the tests).
# Both create .venv and install what they need; CPU installs pin torch via constraints-cpu.txt.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test typecheck install clean wheelhouse

# The offline bundle for a GPU server without internet (README): its Python and CUDA major, and
# what a CUDA PyTorch environment already has (NGC's containers have numpy and numba): 45 MiB.
# Without --skip and with PuLP: 136 MiB (llvmlite alone is 57). gpu_check says in one line when
# the server lacks a skipped package.
WHEELHOUSE      ?= wheelhouse
WHEELHOUSE_ARGS ?= --python 3.12 --cuda 13 --skip numpy,numba --no-pulp

$(BIN)/moment: pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints-cpu.txt -e '.[test]'
	touch $(BIN)/moment

install: $(BIN)/moment

demo: install
	$(BIN)/moment demo

test: install
	$(BIN)/python -m pytest

# The type checker over moment, placement and trainer ([tool.mypy] in pyproject.toml).
typecheck: install
	$(BIN)/mypy

wheelhouse: install
	scripts/wheelhouse.sh $(WHEELHOUSE) $(WHEELHOUSE_ARGS)

clean:
	rm -rf $(VENV) moment-demo build *.egg-info .mypy_cache
