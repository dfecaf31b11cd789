"""Logging for the ``autopar`` command and the ranks it starts: one line per record,
``time level rank N logger: message``, on stderr, so a SLURM log reads like a terminal.

The level comes from ``--log-level`` or ``$AUTOPAR_LOG_LEVEL`` (which ranks inherit)."""

from __future__ import annotations

import logging
import os
import sys

LOG_ENV = "AUTOPAR_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING")
PACKAGES = ("autopar", "runtime", "passes", "cost_models")


class _Handler(logging.StreamHandler):
    """Ours, so configuring twice replaces it instead of printing every line twice."""


def default_level() -> str:
    level = os.environ.get(LOG_ENV, "WARNING").upper()
    return level if level in LEVELS else "WARNING"


def configure_logging(level: str | None = None) -> None:
    """Send autopar's loggers to stderr at ``level`` (default: ``$AUTOPAR_LOG_LEVEL`` or
    WARNING). Lines name the rank (torchrun's ``RANK``) when there is one."""
    level = (level or default_level()).upper()
    rank = os.environ.get("RANK")
    where = f" rank {rank}" if rank is not None else ""
    handler = _Handler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s{where} %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
    for name in PACKAGES:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _Handler)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False  # a script's own root handler would print each line again
