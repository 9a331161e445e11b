# Two commands on a fresh machine:  `make demo` (the main job) and `make test` (the tests).
# Both create .venv and install what they need; CPU installs pin torch via constraints-cpu.txt.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test install clean

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

clean:
	rm -rf $(VENV) moment-demo build *.egg-info
