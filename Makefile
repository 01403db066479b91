# Trainstack: two commands on a fresh machine (Python 3.11 + venv):
#   make run    set up .venv and train the embedded default (2 DDP processes on CPU, digit scans)
#   make test   set up .venv and run the whole test suite (what .ci/run calls)
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
SHELL  := /bin/bash

.PHONY: setup run test clean

export JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION := 1
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

setup: $(VENV)/.installed node_modules/.installed

$(VENV)/.installed: requirements.txt requirements-trainer.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

# The CDK CLI (`npx cdk synth/deploy`), pinned in package.json / package-lock.json.
node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

run: setup
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) -m trainer train --config configs/digits.yaml

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf runs .pytest_cache
