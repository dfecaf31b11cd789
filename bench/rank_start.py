"""How long local ranks take to start: ``runtime.launch.spawn`` of a trivial job on N gloo
ranks (process group initialised, each rank's result returned, ranks joined), with ranks
forked by a forkserver that imported torch once (``runtime.launch.RANK_PRELOAD``, what
``autopar run``, ``autopar calibrate`` and the test pool use) against the spawn start
method, where every rank imports torch itself.

    python bench/rank_start.py                   # 2, 4 and 8 ranks
    python bench/rank_start.py --nproc 2 4

Each case runs in a fresh interpreter that has imported ``runtime.launch`` (and so torch)
before the clock starts, as a user's ``autopar run`` has: "first" is the first start in
that process (for the forkserver, the server's own start and its import of torch
included), "again" a second start in the same process (the test pool's restarts, every
later ``spawn`` of a session).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_case(method: str, nproc: int) -> list[float]:
    """Seconds of two ``spawn`` calls in this process, ranks started by ``method``."""
    import torch.distributed as dist

    from runtime import launch

    if method == "spawn":  # the baseline: what spawn used before rank_context
        launch.rank_context = lambda: mp.get_context("spawn")
    times = []
    for _ in range(2):
        start = time.perf_counter()
        assert launch.spawn(dist.get_rank, nproc, timeout_s=120) == list(range(nproc))
        times.append(time.perf_counter() - start)
    return times


def measured(method: str, nproc: int) -> list[float]:
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, __file__, "--one", method, str(nproc)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "NPROC"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_case(args.one[0], int(args.one[1]))))
        return
    print(f"# {platform.node()}, {os.cpu_count()} CPUs, python {platform.python_version()}")
    print(f"{'ranks':>5}  {'spawn first':>11} {'again':>7}  {'forkserver first':>16} "
          f"{'again':>7}  {'ratio first':>11} {'again':>7}")
    for nproc in args.nproc:
        spawn, fork = measured("spawn", nproc), measured("forkserver", nproc)
        print(f"{nproc:>5}  {spawn[0]:>10.1f}s {spawn[1]:>6.1f}s  {fork[0]:>15.1f}s "
              f"{fork[1]:>6.1f}s  {spawn[0] / fork[0]:>10.1f}x {spawn[1] / fork[1]:>6.1f}x")


if __name__ == "__main__":
    main()
