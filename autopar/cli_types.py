"""argparse types that range-check a flag when it is parsed, before any work.

argparse turns the ``ArgumentTypeError`` into ``autopar CMD: error: argument --flag: …``
and exit status 2. Limits that are not about the flag alone (a world size against a
plan) are checked by the command, still before it plans, spawns or writes.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# Far beyond any real cluster, small enough that nothing downstream enumerates for hours.
MAX_NODES = 100_000
MAX_RANKS_PER_NODE = 1024
MAX_INT = 10**9


def bounded_int(low: int, high: int = MAX_INT, what: str = "an integer") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"expected {what} of at most {high}, got {value}")
        return value

    parse.__name__ = what  # argparse names the type in "invalid <name> value"
    return parse


positive_int = bounded_int(1, what="a positive integer")
nonnegative_int = bounded_int(0, what="an integer >= 0")
node_count = bounded_int(1, MAX_NODES, what="a positive node count")
ranks_per_node = bounded_int(1, MAX_RANKS_PER_NODE, what="a positive rank count per node")
seed = bounded_int(0, 2**63 - 1, what="a seed >= 0")


def positive_seconds(text: str) -> float:
    """A finite number of seconds above zero (not NaN, not inf, not negative)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0 or value > 10**7:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds above 0 and at most 1e7, got {text!r}")
    return value


NUMBERS = {2: "two", 3: "three"}


def positive_ints(what: str, example: str) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: as many comma-separated positive integers as ``example`` has."""
    count = len(example.split(","))

    def parse(text: str) -> tuple[int, ...]:
        parts = text.split(",")
        if len(parts) != count:
            raise argparse.ArgumentTypeError(
                f"expected {what} as {NUMBERS[count]} integers like {example}; "
                f"got {text!r}")
        return tuple(positive_int(p.strip()) for p in parts)

    return parse
