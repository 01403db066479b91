"""The AWS side of Trainstack. Never imports torch.

``config.py`` (typed CDK context), ``app.py`` and ``stacks/{data,monitoring,training,ci}.py`` (CDK),
``constructs/`` (spot launch template, user data, SageMaker spot jobs, CloudWatch agent, cdk-nag
acknowledgements), ``cli/`` (``python -m infra``: push-image, launch, submit, status, logs, stop, teardown,
cost; ``cli/builder.py``, the one place that knows docker/podman/buildah; ``cli/smoke.py``, ``make image-smoke``). The instance catalog (facts and prices, the one copy) is the top-level package ``catalog/``.
"""

import os

# jsii's Node process prints a boxed "Node N is deprecated / end-of-life" banner on stderr, which the jsii
# Python runtime echoes line by line as bytes reprs (b'!!  ...  !!\n'), also in front of our own error lines.
# `make setup`'s node (22 or newer first on its PATH) draws none; these cover jsii run on another node, e.g. the
# venv's python run without .venv/bin on PATH on a machine with Node 20 (jsii's support for it ended 2026-10-30).
# Set here, before any module of this package can import aws_cdk (which starts the Node process); a caller's
# own values win.
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
