"""Which device a rank trains on: one rule for ``compile``, ``autopar run``, the
resumable trainer and the exported scripts.

``device_type="auto"`` (the default everywhere) is CUDA on ``LOCAL_RANK`` when CUDA is
available and the process group's backend can drive it (NCCL), CPU with gloo otherwise.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from runtime.plan import PlanError

DEVICE_TYPES = ("auto", "cpu", "cuda")


def resolve_device_type(device_type: str = "auto") -> str:
    """``"cuda"`` or ``"cpu"``; raises PlanError for an unknown type or CUDA without a GPU."""
    if device_type not in DEVICE_TYPES:
        raise PlanError(f"device_type {device_type!r} is not one of {', '.join(DEVICE_TYPES)}")
    if device_type == "auto":
        if not torch.cuda.is_available():
            return "cpu"
        if dist.is_initialized() and dist.get_backend() == "gloo":
            return "cpu"  # a gloo group cannot all-reduce CUDA tensors
        return "cuda"
    if device_type == "cuda" and not torch.cuda.is_available():
        raise PlanError(
            "device_type='cuda' but torch sees no CUDA device (torch "
            f"{torch.__version__}); use device_type='auto' or 'cpu'"
        )
    return device_type


def rank_device(device_type: str = "auto") -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) or ``cpu``."""
    resolved = resolve_device_type(device_type)
    if resolved == "cuda":
        index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        index %= torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def backend_for(device_type: str = "auto") -> str:
    """The process-group backend for a device type: NCCL for CUDA, gloo for CPU."""
    return "nccl" if resolve_device_type(device_type) == "cuda" else "gloo"
