"""``autopar run`` under torchrun with one injected failure, for tests/runtime/test_checkpoint_elastic.py.

Rank ``AUTOPAR_TEST_FAIL_RANK`` exits hard (``os._exit``: no cleanup, like a killed
process) right after step ``AUTOPAR_TEST_FAIL_STEP``, on the first attempt only
(``TORCHELASTIC_RESTART_COUNT == 0``); torchrun then restarts every rank.
"""

from __future__ import annotations

import os
import sys

from autopar import resumable
from autopar.cli import main

FAIL_STEP = int(os.environ.get("AUTOPAR_TEST_FAIL_STEP", "0"))
FAIL_RANK = int(os.environ.get("AUTOPAR_TEST_FAIL_RANK", "1"))
_train = resumable.train_resumable


def _train_with_failure(*args, on_step=None, **kwargs):
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    rank = int(os.environ["RANK"])

    def hook(step: int, loss: float) -> None:
        if on_step is not None:
            on_step(step, loss)
        if first_attempt and step == FAIL_STEP and rank == FAIL_RANK:
            sys.stdout.flush()
            os._exit(1)

    return _train(*args, on_step=hook, **kwargs)


if __name__ == "__main__":
    resumable.train_resumable = _train_with_failure
    sys.exit(main(sys.argv[1:]))
