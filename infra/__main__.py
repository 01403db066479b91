"""``python -m infra ...``: the operations CLI (infra/cli/main.py)."""

import sys

from infra.cli.main import main

sys.exit(main())
