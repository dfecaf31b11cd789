"""Calibrate this machine at full size and print the table (the profile goes to a temp file).

    python bench/calibrate.py [--nproc 2]

The same as `autopar calibrate`, without leaving a profile behind; the profile's header
lines are printed after the table.
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


if __name__ == "__main__":
    main()
