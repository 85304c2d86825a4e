# `make demo` and `make test` set up .venv on first use (CPU PyTorch from this machine's disk).
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: setup demo test clean
setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# Install the CPU build of torch first: a bare `torch` requirement would pull a CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	.venv/bin/frawd info --preset tiny

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf .venv runs
