"""``python -m trainer.launch [torchrun options] -m trainer train ...``: torchrun, ending the way a job should.

Same options and behaviour as ``torchrun`` (``torch.distributed.run``); the image's entrypoint runs it. Only the
end differs, when a rank fails:

* torchrun raises ``ChildFailedError`` and Python prints the launcher's own traceback above its failure report,
  then exits 1 whatever the rank's status. Here the root-cause rank's status is the exit status (2 bad input,
  3 NaN, 75 interrupted: :mod:`trainer.errors`; 1 for a rank killed by a signal) and no launcher traceback is
  printed;
* a rank that reported its error (:mod:`trainer.failures`) is shown as the one line ``error: <message>``, or not
  at all when ``$TRAINSTACK_FAILURE_DIR`` is set (the entrypoint prints it last, from the rank's record);
* any other failure (a bug: the rank printed its traceback) prints torchrun's failure report (ranks, exit codes,
  signals, root cause).

A signal that stops the launcher itself (SIGTERM/SIGINT, relayed by torchrun to the ranks) ends it with
128 + the signal number, without a traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Optional

from trainer.errors import EXIT_INTERRUPTED
from trainer.failures import FAILURE_DIR_ENV, reported_exit


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run torchrun with ``argv`` (default ``sys.argv[1:]``); returns the exit status described above."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        code = reported_exit(failure.error_file_data)
        if code is None:
            print(str(e).strip("\n"), file=sys.stderr, flush=True)
            return failure.exitcode if failure.exitcode > 0 else 1
        if code != EXIT_INTERRUPTED and not os.environ.get(FAILURE_DIR_ENV):  # rank 0 printed "interrupted: ..."
            message = failure.error_file_data["message"].get("message", "")
            print(message, file=sys.stderr, flush=True)
        return code
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
