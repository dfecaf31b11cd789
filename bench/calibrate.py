"""Calibrate this machine at full size and print the table (the profile goes to a temp file).

    python bench/calibrate.py [--nproc 2]

The same as `autopar calibrate`, without leaving a profile behind; the profile's header
lines are printed after the table, then the overlap slowdown σ per pattern (median of the
window pairs, their range) and the spread of the GEMM windows (min..max over median).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from autopar.calibrate import Settings, calibrate, format_table, write_profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cal = calibrate(args.nproc, settings=Settings.quick() if args.quick else Settings())
    print(format_table(cal))
    with tempfile.TemporaryDirectory() as tmp:
        cluster = write_profile(cal, Path(tmp) / "profile.toml")
    d, link = cluster.device, cluster.intra_node
    print(f"\nprofile: {cluster.source}")
    print("peak_tflops " + ", ".join(f"{k} {v / 1e12:.4g}" for k, v in d.peak_flops.items())
          + f"; matmul_efficiency {d.matmul_efficiency:.3f}; memory {d.memory_bandwidth_GBps:.3g} "
          f"GB/s; link {link.bandwidth_GBps:.3g} GB/s, {link.latency_s * 1e6:.0f} us")
    o = cluster.overlap
    print("overlap slowdown (profile): "
          f"dp {o.dp_slowdown:.3g}, fsdp {o.fsdp_slowdown:.3g}, pp {o.pp_slowdown:.3g}; pairs: "
          + ", ".join(f"{k} {s.low:.3g}..{s.high:.3g}" for k, s in cal.overlap.items()))
    for dtype, by_size in cal.gemm_spread.items():
        print(f"GEMM {dtype} windows, GFLOP/s min/median/max (spread): " + "; ".join(
            f"{n} {s.low / 1e9:.1f}/{s.median / 1e9:.1f}/{s.high / 1e9:.1f} ({s.relative:.0%})"
            for n, s in by_size.items()))


if __name__ == "__main__":
    main()
