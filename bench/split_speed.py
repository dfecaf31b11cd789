"""Pipeline stage splitting: symbolic tracing against PyTorch's export-based ``pipeline()``.

    python bench/split_speed.py            # gpt-tiny, 6 blocks, 2 stages, median of 5

``passes.split_stages.split_pipeline`` splits with ``torch.fx`` symbolic tracing where it
can and falls back to a ``torch.export`` capture split by ``torch.distributed.pipelining.
pipeline()``; this times both methods on the same model and plan, in one process.
"""

from __future__ import annotations

import argparse
import statistics
import time

from autopar.zoo import get_model
from passes.split_stages import split_pipeline
from runtime.plan import LayerPlan, Mesh, PipelineSpec, Plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    spec = get_model("gpt-tiny").with_config(n_layer=args.blocks)
    names = ["wte", "wpe", *(f"h.{i}" for i in range(args.blocks)), "ln_f", "lm_head"]
    half = len(names) // 2
    plan = Plan(global_batch=8, mesh=Mesh(pp=2),
                pipeline=PipelineSpec(schedule="GPipe", num_microbatches=2),
                layers=tuple(LayerPlan(module=n, stage=int(i >= half))
                             for i, n in enumerate(names)))
    (tokens,), _ = spec.make_batch(4, 16)
    print(f"gpt-tiny, {args.blocks} blocks, 2 stages; median of {args.repeats} splits")
    print(f"{'method':<15} {'split s':>8}")
    for method in ("symbolic_trace", "export"):
        times = []
        for _ in range(args.repeats):
            model = spec.build(seed=0)
            start = time.perf_counter()
            split_pipeline(model, plan, (tokens,), method=method)
            times.append(time.perf_counter() - start)
        print(f"{method:<15} {statistics.median(times):>8.3f}", flush=True)


if __name__ == "__main__":
    main()
