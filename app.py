"""CDK entry point (cdk.json runs it): ``npx cdk deploy TrainingStack [-c env=pr-42] [-c key=value ...]``.

The stacks live in infra/ (see infra/app.py and infra/config.py for every context key). Never imports torch.
A bad context value prints one line ``error: context KEY: ...`` and exits 2 (infra.app.main).
"""

import sys

from infra.app import main

sys.exit(main())
