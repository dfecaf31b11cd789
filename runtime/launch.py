"""Start ranks: local processes for tests and small runs, or torchrun's environment.

``spawn`` runs a function on ``nproc`` fresh local processes (forked by a forkserver that
imported torch once: ``rank_context``) with the default process group initialised
(127.0.0.1, a free port) and returns each rank's result. A failing rank is reported in the
parent with its rank, exception and traceback; nothing waits forever: the process group
has a timeout and the parent gives up after ``timeout_s``.

``init_from_env`` is the torchrun path: it reads RANK / WORLD_SIZE / LOCAL_RANK, picks NCCL
and the local CUDA device when one is available and gloo on CPU otherwise.

``launched_plan`` is how a plan passed by path (``autopar run train.py --plan p.json``, the
exported scripts) reaches ``autopar.compile`` in the user's script: ``$AUTOPAR_PLAN``.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cost_models.errors import AutoparError
from runtime.device import backend_for, rank_device
from runtime.plan import Plan

logger = logging.getLogger(__name__)

PLAN_ENV = "AUTOPAR_PLAN"
"""Path of the plan JSON that ``autopar.compile`` executes when it is given no plan."""
_compile_called = False


class LaunchError(AutoparError, RuntimeError):
    """A rank failed, or did not answer in time; the message names the rank and the cause."""


RANK_PRELOAD = ("torch", "torch.distributed.fsdp", "torch.distributed.pipelining",
                "torch.distributed.tensor", "runtime.train")
"""What the forkserver imports before it forks local ranks, so that no rank imports torch
itself (bench/rank_start.py measures the start-up against spawn). The server runs no torch
op, so it holds no thread pool or CUDA context that a fork would break."""


def rank_context() -> Any:
    """The multiprocessing context that starts local ranks (``RANK_PRELOAD``); spawn where
    the platform has no forkserver (Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))
    return ctx


def free_port() -> int:
    """A TCP port that was free a moment ago (the usual race is acceptable for local runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_local_process_group(
    rank: int, world_size: int, port: int, *, backend: str = "gloo", timeout_s: float = 60
) -> None:
    """Initialise the default process group of one local rank (also used by the test pool)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _spawn_worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    try:
        init_local_process_group(rank, world_size, port, backend=backend, timeout_s=timeout_s)
        out = fn(*args)
        # Leave together: a rank that tears down while a peer is still finishing the last
        # collective aborts the peer ("terminate called without an active exception").
        dist.barrier()
        # Plain pickle: tensors travel as bytes, not as shared-memory handles that die
        # with the child.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 60,
) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks; return the results, indexed by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). Raises LaunchError
    naming the first rank that failed (with its traceback), or the ranks that did not
    finish within ``timeout_s``.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_spawn_worker,
            args=(rank, nproc, port, backend, timeout_s, fn, args, results),
            daemon=True,
        )
        for rank in range(nproc)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(results, procs, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


def _collect(results: Any, procs: list, timeout_s: float) -> list[Any]:
    nproc = len(procs)
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s + 30  # + process start and import of torch
    while len(out) < nproc:
        try:
            rank, ok, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in out and not p.is_alive()]
            if dead and results.empty():
                codes = {r: procs[r].exitcode for r in dead}
                raise LaunchError(
                    f"rank(s) {dead} exited without a result (exit codes {codes})"
                ) from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(nproc)) - set(out))
                raise LaunchError(
                    f"rank(s) {missing} did not finish within {timeout_s:.0f} s"
                ) from None
            continue
        if not ok:
            raise LaunchError(f"rank {rank} of {nproc} failed: {value}")
        out[rank] = pickle.loads(value)
    return [out[r] for r in range(nproc)]


def init_from_env(*, device_type: str = "auto", timeout_s: float = 600) -> str:
    """Initialise the default process group from torchrun's environment; return the device type.

    ``auto``: NCCL on the CUDA device ``LOCAL_RANK`` when CUDA is available, gloo on CPU
    otherwise (``runtime.device``).
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise LaunchError(
            f"environment variable(s) {missing} not set; start the script with torchrun "
            "(e.g. `torchrun --nproc-per-node 4 train.py`) or use runtime.launch.spawn"
        )
    device = rank_device(device_type)  # cuda:LOCAL_RANK, made current, or cpu
    device_type = device.type
    if not dist.is_initialized():
        dist.init_process_group(
            backend_for(device_type), timeout=datetime.timedelta(seconds=timeout_s),
        )
    logger.info(
        "rank %d/%d initialised (%s, %s)",
        dist.get_rank(), dist.get_world_size(), dist.get_backend(), device_type,
    )
    return device_type


def launched_plan(plan: Plan | None) -> Plan | None:
    """For ``autopar.compile``: ``plan`` if given, else the plan at ``$AUTOPAR_PLAN`` (None
    when unset). Records that compile ran, for ``compile_called``."""
    global _compile_called
    _compile_called = True
    path = os.environ.get(PLAN_ENV)
    if plan is not None or not path:
        return plan
    logger.info("executing the plan %s (from $%s)", path, PLAN_ENV)
    return Plan.load(path)


def compile_called() -> bool:
    """Whether ``autopar.compile`` ran in this process (``launched_plan`` was asked)."""
    return _compile_called
