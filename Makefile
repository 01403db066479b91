# Trainstack: two commands on a fresh machine (Python 3.11 + venv):
#   make run    set up .venv and train the embedded default (2 DDP processes on CPU, digit scans)
#   make test   set up .venv, compile the deformable-attention op (sm_80, no GPU needed), ruff, run all tests
#               (what .ci/run calls)
#   make ffcv   the optional FFCV extra (apt packages when missing, as root; requirements-ffcv.txt)
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
# pytest-xdist workers for `make test` (whole test files per worker, heaviest files first: tests/conftest.py;
# one intra-op thread each; 0 = in one process)
TEST_WORKERS ?= 2
SHELL  := /bin/bash

.PHONY: setup run test clean msda image image-cpu ffcv lint format
MSDA_ARCHS ?= 8.0

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

# Our deformable-attention CUDA op (trainer/ops/msda), compiled without a GPU; the image runs the same script
# for 8.0;8.6;9.0. Idempotent: ~2 s when already built.
msda: setup
	TORCH_CUDA_ARCH_LIST="$(MSDA_ARCHS)" PYTHON=$(PY) bash images/build_msda.sh

# Optional FFCV extra (--use-ffcv, write-ffcv): ffcv 1.0.2 builds a C extension against these system packages.
# apt runs only for packages dpkg does not list as installed, and needs root; then the pinned pip packages.
FFCV_APT := pkg-config libturbojpeg0-dev libopencv-dev
ffcv: $(VENV)/.ffcv-installed

$(VENV)/.ffcv-installed: requirements-ffcv.txt $(VENV)/.installed
	@missing=$$(for p in $(FFCV_APT); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	missing=$$(echo $$missing); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "error: the ffcv extra needs the system packages: $$missing. As root: apt-get install -y $$missing; then make ffcv" >&2; \
	    exit 2; \
	  fi; \
	  echo "apt-get install $$missing"; \
	  apt-get -o DPkg::Lock::Timeout=600 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq $$missing >/dev/null; \
	fi
	$(PY) -m pip install -q -r requirements-ffcv.txt
	touch $@

# ruff.toml: formatter and linter with a fixed line length; `make format` rewrites, `make lint` only checks.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: setup msda ffcv lint
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=60 tests

# Need a Docker engine (not on the CI machine; CI runs hadolint and the same build script instead).
image:
	docker build -f images/training/Dockerfile -t trainstack-training .
image-cpu:
	docker build -f images/training/Dockerfile --build-arg MSDA=reference \
	  --build-arg BASE_IMAGE=763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.10.0-cpu-py313-ubuntu22.04-sagemaker \
	  -t trainstack-training:cpu .

clean:
	rm -rf runs .pytest_cache trainer/ops/msda/build trainer/ops/msda/_C*.so trainer/ops/msda/.build-stamp
