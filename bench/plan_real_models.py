"""Planning time for the test suite's real models (tests/real_models.py: Hugging Face Llama,
GPT-2, BERT, T5 and ViT from small configs, a nanoGPT with tied embeddings, a ResNet-50
layout, a model taking a dict batch) on DGX A100 clusters of 1 and 4 nodes.

    python bench/plan_real_models.py              # global batch 32
    python bench/plan_real_models.py --batch 256

Each row times ``autopar.plan`` end to end on a model built on the meta device: capture
(torch.export or symbolic tracing, whichever works first), the layer graph, the mesh and
pipeline search with the ILP, and the runtime's validation of the plan against the model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import autopar
from cost_models.hardware import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from real_models import MODELS, planning_inputs  # noqa: E402 - the suite's zoo


def plan_once(name: str, nodes: int, batch: int) -> tuple[float, str, str]:
    spec = MODELS[name]
    with torch.device("meta"):
        model = spec.make()
    inputs = planning_inputs(spec, spec.batch(batch))
    start = time.perf_counter()
    plan = autopar.plan(model, Cluster.preset("dgx-a100-80g", nodes=nodes), inputs)
    seconds = time.perf_counter() - start
    strategies = sorted({layer.strategy for layer in plan.layers})
    return seconds, plan.mesh.describe(" × "), ", ".join(strategies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    print(f"{'model':<16} {'GPUs':>4} {'plan s':>6}  {'mesh':<26} strategies")
    for name in MODELS:
        for nodes in (1, 4):
            seconds, mesh, strategies = plan_once(name, nodes, args.batch)
            print(f"{name:<16} {nodes * 8:>4} {seconds:>6.2f}  {mesh:<26} {strategies}",
                  flush=True)


if __name__ == "__main__":
    main()
