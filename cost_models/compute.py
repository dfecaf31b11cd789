"""Compute time: a roofline over a layer's ops, with GEMM efficiency that depends on size.

    time = max(FLOPs / (peak · efficiency), bytes / memory bandwidth) + kernels · floor

Matrix multiplies far from peak when small. Achievable efficiency is a saturating curve of
the GEMM's smallest dimension d (elements), per compute dtype:

    efficiency(d) = E∞ · d / (d + d½)

E∞ is ``Device.matmul_efficiency`` (the large-GEMM asymptote: what the device's GEMMs
reach alone) times ``Device.software_efficiency`` (what the training software keeps of it,
``cost_models.software``), d½ is
``Device.half_dim(dtype)``: the dimension at which a GEMM reaches half of it. The smallest
dimension is what tiling sees: a GEMM narrower than a few tiles (cuBLAS's tensor-core tiles
are 64 to 256 wide) leaves SMs idle or short of data reuse (NVIDIA, "Matrix Multiplication
Background User's Guide", 2023, sections 2.3 and 3). The per-kernel floor covers launch and
tail, so the curve models only what the floor does not. ``autopar calibrate`` fits E∞·peak
and d½ from measured GEMM times (``cost_models.calibrate.fit_gemm_curve``). Without a
dimension, a roofline uses E∞, the large-GEMM rate; ``gemm_shortfall_flops`` prices a
layer's GEMMs at their own sizes inside one roofline.

Memory-bound ops run at ``memory_bandwidth_GBps``. Applied to a layer's totals the roofline
bounds the layer by its slower resource.
"""

from __future__ import annotations

from collections.abc import Iterable

from cost_models.hardware import Device


def gemm_efficiency(device: Device, dtype: str, min_dim: float | None = None) -> float:
    """Achievable fraction of ``dtype``'s peak for a GEMM whose smallest dimension is
    ``min_dim`` (None: a large GEMM, the asymptote)."""
    asymptote = device.matmul_efficiency * device.software_efficiency
    if min_dim is None:
        return asymptote
    if min_dim <= 0:
        raise ValueError(f"a GEMM dimension must be positive, got {min_dim}")
    return asymptote * min_dim / (min_dim + device.half_dim(dtype))


def roofline_s(flops: float, mem_bytes: float, num_ops: float, device: Device, dtype: str,
               *, gemm_min_dim: float | None = None) -> float:
    """Time of ops doing ``flops`` and moving ``mem_bytes``, in ``num_ops`` kernels.

    ``gemm_min_dim``: the smallest dimension of the GEMMs doing the FLOPs, when known.
    """
    rate = device.peak(dtype) * gemm_efficiency(device, dtype, gemm_min_dim)
    t_mem = mem_bytes / (device.memory_bandwidth_GBps * 1e9)
    return max(flops / rate, t_mem) + num_ops * device.kernel_floor_s


def gemm_shortfall_flops(gemms: Iterable[tuple[float, float]], device: Device,
                         dtype: str) -> float:
    """FLOPs that GEMMs lose to their size, counted at the large-GEMM rate.

    ``gemms``: (FLOPs, smallest dimension d) of each GEMM. At efficiency(d) a GEMM of f FLOPs
    takes as long as f·E∞/efficiency(d) = f·(d + d½)/d FLOPs at the asymptote, that is
    f·d½/d more than f. So a roofline over FLOPs F, of which these GEMMs are part, prices
    every GEMM at its own efficiency and the rest (fused attention, convolutions) at E∞ as

        roofline_s(F + gemm_shortfall_flops(gemms, ...), bytes, kernels, ...)

    still bounded below by the memory term. Exactly 0 when d½ is 0 (GEMMs of any size
    saturate). A matmul's backward runs two GEMMs over the same three dims, so backward
    FLOPs lose the same share.
    """
    half = device.half_dim(dtype)
    total = 0.0
    for flops, min_dim in gemms:
        if min_dim <= 0:
            raise ValueError(f"a GEMM dimension must be positive, got {min_dim}")
        total += flops * half / min_dim
    return total


def gemm_bytes(m: int, n: int, k: int, bytes_per_element: int = 2) -> int:
    """Bytes one (m×k)·(k×n) GEMM moves: both inputs read and the output written once."""
    return (m * k + k * n + m * n) * bytes_per_element


def gemm_s(m: int, n: int, k: int, device: Device, dtype: str, *,
           bytes_per_element: int = 2) -> float:
    """One (m×k)·(k×n) GEMM, moving ``gemm_bytes``."""
    flops = 2.0 * m * n * k
    moved = gemm_bytes(m, n, k, bytes_per_element)
    return roofline_s(flops, moved, 1, device, dtype, gemm_min_dim=min(m, n, k))
