# Two entry points on a fresh machine:
#   make serve   create .venv, install octo with its engines, serve the synthetic demo model (offline)
#   make test    create .venv, install everything (system packages too), run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -c constraints.txt
PORT ?= 8080

.PHONY: serve test install install-dev lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.octo-installed: $(PY) pyproject.toml constraints.txt
	$(PIP) -e ".[llamacpp,onnx,mlx,synth]"
	touch $@

$(VENV)/.octo-dev-installed: $(PY) pyproject.toml constraints.txt
	./scripts/system-deps.sh
	$(PIP) -e ".[all,synth,dev,bench,ray]"
	touch $@

install: $(VENV)/.octo-installed
install-dev: $(VENV)/.octo-dev-installed

serve: install
	$(VENV)/bin/octo serve demo --port $(PORT)

test: install-dev
	$(PY) -m pytest -q

lint: install-dev
	$(VENV)/bin/ruff check octo engines plugins tests bench

bench: install-dev
	$(PY) bench/overhead.py

clean:
	rm -rf $(VENV) .cache .pytest_cache
