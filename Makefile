# `make demo` and `make test` set up .venv on first use (CPU PyTorch from this machine's disk).
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: help setup demo test clean
help:
	@echo "make demo   set up .venv, train a small GPT on the standard library (~3 min), complete a function"
	@echo "make test   set up .venv and run the test suite"
	@echo "make setup  only set up .venv (CPU PyTorch, the package editable with its test extras)"
	@echo "make clean  remove .venv, runs/ and the package's build metadata"

setup: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# Install the CPU build of torch first: a bare `torch` requirement would pull a CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# The main job: a small GPT learns Python from the standard library (about 3 minutes on
# 2 CPU cores, its own BPE tokenizer), then completes a function signature.
demo: $(STAMP)
	.venv/bin/frawd pretrain --config configs/demo_stdlib.yaml --out runs/demo --overwrite
	.venv/bin/frawd generate --model runs/demo/model --prompt "def fibonacci(n):" --echo-prompt \
		--max-new-tokens 120 --temperature 0.7 --top-k 40 --seed 0

# One pytest-xdist worker per CPU, each test file on one worker (a file's shared fixtures are
# built once), the reason of each skip listed at the end; `$(PY) -m pytest -q tests/test_x.py` runs
# one file alone.
test: $(STAMP)
	$(PY) -m pytest -q -rs -n auto --dist loadfile

clean:
	rm -rf .venv runs frawdllm.egg-info
