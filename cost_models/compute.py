"""Compute time: a roofline over a layer's ops.

time = max(FLOPs / (peak · matmul_efficiency), bytes / memory bandwidth) + kernels · floor

Applied to a layer's totals, this is a bound-by-the-slower-resource estimate; the per-op
refinement (small GEMMs far from peak, memory-bound ops) belongs to calibration.
"""

from __future__ import annotations

from cost_models.hardware import Device

# Adam's step reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq:
# 7 tensors of one parameter each (torch.optim.AdamW, foreach implementation).
ADAM_TENSORS_TOUCHED = 7


def roofline_s(flops: float, mem_bytes: float, num_ops: float, device: Device, dtype: str) -> float:
    t_flops = flops / (device.peak(dtype) * device.matmul_efficiency)
    t_mem = mem_bytes / (device.memory_bandwidth_GBps * 1e9)
    return max(t_flops, t_mem) + num_ops * device.kernel_floor_s


def optimizer_step_s(local_params: float, state_bytes_per_param: float, device: Device) -> float:
    """Adam over the parameters this rank holds: memory-bound elementwise work."""
    return local_params * state_bytes_per_param * ADAM_TENSORS_TOUCHED / 4 / (
        device.memory_bandwidth_GBps * 1e9
    )
