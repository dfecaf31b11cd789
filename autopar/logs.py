"""Logging for the ``autopar`` command and the ranks it starts: one line per record,
``time level rank N logger: message``, on stderr, so a SLURM log reads like a terminal.

The level comes from ``--log-level`` or ``$AUTOPAR_LOG_LEVEL`` (which ranks inherit).
``configured_logging`` puts the loggers back as they were when it ends, so calling the CLI's
``main`` in a process that has its own logging (a notebook, a test) leaves it untouched."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

LOG_ENV = "AUTOPAR_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING")
PACKAGES = ("autopar", "runtime", "passes", "cost_models")


def default_level() -> str:
    level = os.environ.get(LOG_ENV, "WARNING").upper()
    return level if level in LEVELS else "WARNING"


@contextmanager
def configured_logging(level: str | None = None, *, propagate: bool = True) -> Iterator[None]:
    """Send autopar's loggers to stderr at ``level`` (default: ``$AUTOPAR_LOG_LEVEL`` or
    WARNING) while the block runs. Lines name the rank (torchrun's ``RANK``) when there is
    one. ``propagate=False`` keeps a script's own root handler from printing them again."""
    rank = os.environ.get("RANK")
    where = f" rank {rank}" if rank is not None else ""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s{where} %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
    loggers = [logging.getLogger(name) for name in PACKAGES]
    saved = [(logger.level, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel((level or default_level()).upper())
        logger.propagate = propagate
    try:
        yield
    finally:
        for logger, (old_level, old_propagate) in zip(loggers, saved, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(old_level)
            logger.propagate = old_propagate
