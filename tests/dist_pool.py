"""A pool of gloo ranks that lives for the whole pytest session and runs many jobs.

Starting ranks costs seconds (each imports torch); a job on ranks that are already up costs
milliseconds. So each world size gets one pool, started on first use, and every test sends
it jobs: a module-level function plus picklable arguments, run on every rank, returning one
result per rank. Ranks start as ``runtime.launch.spawn``'s do, forked by a forkserver that
imported torch once (``runtime.launch.RANK_PRELOAD``).

A failed job never hangs the suite: the parent waits at most ``timeout_s`` (the process
group times out too), then raises ``DistJobError`` naming each failing rank with its
traceback and restarts the pool, since a failure can leave gloo connections broken.
Results travel pickled as bytes (tensors included), never as shared-memory handles.
"""

from __future__ import annotations

import importlib
import itertools
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

from runtime.launch import free_port, init_local_process_group, rank_context

PG_TIMEOUT_S = 30.0
"""Process-group timeout inside the workers: a collective one rank never joins fails."""
JOB_TIMEOUT_S = 90.0
"""Default time the parent waits for all ranks of one job."""
FAILURE_GRACE_S = 5.0
"""After one rank fails, how long to wait for the others before giving up on them."""

RANKS = pytest.mark.xdist_group("ranks")
"""Tests that run gloo ranks: on the pools (tests/conftest.py marks them) or spawned by the
test itself (marked ``@RANKS``, or ``pytestmark = RANKS`` for a whole module). Under
``--dist loadgroup`` (README) they all run on one xdist worker: their ranks already keep
both cores busy, so ranks of two workers at once only contend and time out, while the
single-process tests (planner searches, cost models) run on the other worker beside them."""


class DistJobError(AssertionError):
    """A job failed or timed out on some rank; the message has each rank's traceback."""


def _worker(rank: int, world_size: int, port: int, jobs: Any, results: Any) -> None:
    import warnings

    # FSDP2 warns on every forward that a module returned a view; our losses are
    # out-of-place, and the noise drowns real failures in the test log.
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    try:
        init_local_process_group(rank, world_size, port, timeout_s=PG_TIMEOUT_S)
    except BaseException as e:  # noqa: BLE001
        results.put((0, rank, False, f"init failed: {e}\n{traceback.format_exc()}"))
        return
    results.put((0, rank, True, pickle.dumps("ready")))
    while True:
        job = jobs.get()
        if job is None:
            break
        job_id, module, name, args, kwargs = pickle.loads(job)
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((job_id, rank, True, pickle.dumps(fn(*args, **kwargs))))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            results.put((job_id, rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    import torch.distributed as dist

    dist.destroy_process_group()


class DistPool:
    """``world_size`` gloo ranks waiting for jobs. Start lazily; ``close`` when done."""

    def __init__(self, world_size: int, *, timeout_s: float = JOB_TIMEOUT_S) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._procs: list[Any] = []
        self.starts = 0
        """How many times ranks were spawned (1 unless a job failed)."""

    def _start(self) -> None:
        ctx = rank_context()
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, self._jobs[r], self._results),
                        daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self.starts += 1
        self._gather(0, timeout_s=60.0, what="start-up")

    def close(self) -> None:
        for q, p in zip(getattr(self, "_jobs", []), self._procs, strict=False):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results indexed by rank."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        job_id = next(self._ids)
        payload = pickle.dumps((job_id, fn.__module__, fn.__qualname__, args, kwargs))
        for q in self._jobs:
            q.put(payload)
        return self._gather(job_id, timeout_s=timeout_s or self.timeout_s,
                            what=f"job {fn.__qualname__}")

    def _gather(self, job_id: int, *, timeout_s: float, what: str) -> list[Any]:
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) + len(errors) < self.world_size:
            if errors:  # the other ranks are likely stuck in a collective: don't wait long
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            left = deadline - time.monotonic()
            try:
                got_id, rank, ok, value = self._results.get(timeout=max(0.05, min(1.0, left)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if left <= 0 or (dead and self._results.empty()):
                    missing = sorted(set(range(self.world_size)) - set(out) - set(errors))
                    if dead:
                        cause = f"no result; rank(s) {dead} died"
                    elif errors:
                        cause = "no result; probably stuck in a collective with a failed rank"
                    else:
                        cause = f"no result within {timeout_s:.0f} s"
                    errors.update({r: cause for r in missing})
                    break
                continue
            if got_id != job_id:
                continue  # a straggler from an earlier, failed job
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors[rank] = value
        if errors:
            self.close()  # a failure can leave gloo connections broken: restart next time
            detail = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items()))
            raise DistJobError(
                f"{what} failed on rank(s) {sorted(errors)} of {self.world_size}:\n{detail}"
            )
        return [out[r] for r in range(self.world_size)]
