"""``count_inplace_inputs``: which of a layer's inputs its forward modifies in place.

Recomputing such a layer costs a copy of those inputs (runtime/recompute.py: the rerun
must start from the values the forward saw, which the layer overwrites), and the planner
charges it (``LayerInfo.inplace_input_bytes``, autopar/planner/costs.py).

Found by running the layer's nodes on fresh meta inputs and watching each input's version
counter, which every in-place op bumps, on views of the input too: whatever form the
capture gives the op (a ``ReLU(inplace=True)`` leaf module or ``relu_`` call under
symbolic tracing, ``aten.relu_``/``aten.add_`` under export) is caught alike, and
parameters and buffers (``get_attr``, such as BatchNorm's step counter) are not inputs.
Symbolic tracing records ``x += y`` as ``x + y`` (torch.fx proxies have no in-place
operators), so that form is seen only in an exported graph; the runtime finds every form
on the layer's first call, so this only affects the cost.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node

from passes import meta_keys as K
from passes.annotate import run_nodes


def count_inplace_inputs(gm: GraphModule, nodes: list[Node], env: dict[Node, object]) -> None:
    """INPLACE_INPUTS: on each node of ``nodes``, the floating bytes of the layer's inputs
    it is the first to modify in place (0 on the others)."""
    inputs: list[tuple[torch.Tensor, int, int]] = []  # (tensor, version before, bytes)

    def on_input(node: Node, value: object) -> None:
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                inputs.append((t, t._version, t.numel() * t.element_size()))

    def after(node: Node, out: object) -> None:
        changed = [item for item in inputs if item[0]._version != item[1]]
        node.meta[K.INPLACE_INPUTS] = sum(nbytes for _, _, nbytes in changed)
        for item in changed:
            inputs.remove(item)

    with torch.no_grad():
        run_nodes(gm, nodes, env, "count_inplace_inputs", after=after, on_input=on_input,
                  fresh_inputs=True)


def inplace_input_bytes(nodes: list[Node]) -> int:
    """``LayerInfo.inplace_input_bytes`` from the nodes' INPLACE_INPUTS."""
    return int(sum(n.meta.get(K.INPLACE_INPUTS, 0) for n in nodes))
