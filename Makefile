# Two entry points on a fresh machine:
#   make serve   create .venv, install octo with its engines (speech too), serve the synthetic demo model (offline)
#   make test    create .venv, install everything (system packages too), run the whole test suite
# scripts/install.py checks the prerequisites first (Python 3.11+ with venv; a C/C++ compiler: pip compiles llama.cpp,
# 10-15 minutes on 2 cores) and shows each step. `make serve LLAMACPP=no` leaves llama.cpp out (nothing to compile).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8080
LLAMACPP ?= yes
INSTALL := $(PYTHON) scripts/install.py --venv $(VENV) $(if $(filter no,$(LLAMACPP)),--no-llamacpp)

.PHONY: serve test install install-dev lint bench clean

$(VENV)/.octo-installed: pyproject.toml constraints.txt
	$(INSTALL) --extras llamacpp,onnx,mlx,synth,whisper,speech,tour
	touch $@

$(VENV)/.octo-dev-installed: pyproject.toml constraints.txt
	./scripts/system-deps.sh
	$(INSTALL) --extras all,synth,dev,bench,ray
	touch $@

install: $(VENV)/.octo-installed
install-dev: $(VENV)/.octo-dev-installed

serve: install
	@echo "octo: serving the synthetic demo model with $(VENV)/bin/octo ('source $(VENV)/bin/activate' puts octo on PATH)"
	$(VENV)/bin/octo serve demo --port $(PORT)

test: install-dev
	$(PY) -m pytest -q

lint: install-dev
	$(VENV)/bin/ruff check octo engines plugins tests bench

SUITE ?= gateway
bench: install-dev
	$(PY) bench/run.py $(SUITE)

clean:
	rm -rf $(VENV) .cache .pytest_cache
