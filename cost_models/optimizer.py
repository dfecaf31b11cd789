"""The optimizer step: Adam(W)'s memory-bound passes over the parameters a rank holds.

One step reads and writes float32 tensors of each parameter's size (the parameter or its
float32 master copy, the gradient, the two moments, temporaries) at memory bandwidth, and
launches a few kernels per parameter tensor or per group of tensors. Implementations
differ in both (``ADAM_KERNELS``):

- ``adamw-for-loop``: ``torch.optim.AdamW``'s default on CPU tensors (``_single_tensor_adam``,
  torch/optim/adam.py): per parameter tensor ``param.mul_`` (weight decay, r+w),
  ``exp_avg.lerp_(grad)`` (r, r, w), ``exp_avg_sq.mul_`` (r+w) and ``.addcmul_(grad, grad)``
  (r, r, w), ``denom = exp_avg_sq.sqrt()`` (r, w) ``/ bias_correction2_sqrt`` (r, w)
  ``.add_(eps)`` (r+w), ``param.addcdiv_(exp_avg, denom)`` (r, r, r, w): 20 passes in 8
  kernels per tensor, and 2 more ops on its step count (``step_t += 1``,
  ``.item()``).
- ``adamw-foreach``: its default on CUDA tensors (``_multi_tensor_adam``): the same 20
  passes as ``torch._foreach_*`` ops, each one multi-tensor launch over a layer's tensors.
- ``fused-adam``: one fused kernel (``fused=True``, apex's FusedAdam in Megatron-LM) that
  reads parameter, gradient and both moments and writes parameter and moments: 7 passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cost_models.hardware import Device

FP32_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class AdamKernels:
    name: str
    fp32_passes: int
    """Float32 tensors of one parameter's size read or written per step."""
    kernels: int
    """Kernel launches per parameter tensor (``per_tensor``) or per layer."""
    per_tensor: bool


ADAM_KERNELS = {
    k.name: k for k in (
        AdamKernels(name="adamw-for-loop", fp32_passes=20, kernels=10, per_tensor=True),
        AdamKernels(name="adamw-foreach", fp32_passes=20, kernels=8, per_tensor=False),
        AdamKernels(name="fused-adam", fp32_passes=7, kernels=1, per_tensor=False),
    )
}
DEFAULT_OPTIMIZER = "adamw-foreach"
"""What autopar's runtime runs on GPUs: ``torch.optim.AdamW`` with its defaults."""


def optimizer_step_s(local_params: float, param_tensors: int, kernels: AdamKernels,
                     device: Device, *, bandwidth_GBps: float | None = None) -> float:
    """One Adam step over ``local_params`` parameters in ``param_tensors`` tensors on one
    rank, at the device's memory bandwidth or ``bandwidth_GBps`` (host memory, for
    offloaded states)."""
    bandwidth = device.memory_bandwidth_GBps if bandwidth_GBps is None else bandwidth_GBps
    launches = kernels.kernels * (param_tensors if kernels.per_tensor else 1)
    passes = local_params * FP32_BYTES * kernels.fp32_passes / (bandwidth * 1e9)
    return passes + (launches * device.kernel_floor_s if local_params else 0.0)
