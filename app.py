"""CDK entry point (cdk.json runs it): ``npx cdk deploy TrainingStack [-c env=pr-42] [-c key=value ...]``.

The stacks live in infra/ (see infra/app.py and infra/config.py for every context key). Never imports torch.
"""

import os

os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")

from infra.app import build_app  # noqa: E402

app, _config, _stacks = build_app()
app.synth()
