"""``python -m trainer ...`` (see :mod:`trainer.cli`)."""

import sys

from trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
