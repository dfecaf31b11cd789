"""Capture: an nn.Module + example inputs -> a torch.fx GraphModule on meta/fake tensors.

Primary method ``torch.export.export(strict=False)``; fallback ``torch.fx.symbolic_trace``
with ``opaque`` module paths as leaf modules (see ``passes.trace`` for the mechanics, which
live there so that ``passes.layer_graph`` can capture without importing ``autopar``).

Every call_* node keeps ``nn_module_stack``, so it knows the fully-qualified name of the
module that ran it (names as in ``model.named_modules()``). Models built on the meta device
with meta example inputs are captured without allocating weights. Hugging Face models
must be built with ``use_cache=False``. How the graph was captured is recorded under
``gm.meta[passes.meta_keys.CAPTURE]``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx
import torch.nn as nn

from passes.trace import trace_module


def capture(
    model: nn.Module,
    example_inputs: object,
    *,
    opaque: Iterable[str] = (),
    prefer: str = "export",
) -> torch.fx.GraphModule:
    """Capture ``model`` called on ``example_inputs``: a tensor, a tuple of positional
    arguments, a dict of keyword arguments or ``autopar.Inputs(args, kwargs)``. The
    graph's placeholders take ``passes.trace.placeholder_values(gm, example_inputs)``.

    ``opaque``: module paths to keep as single call_module nodes (planned as one unit).
    ``prefer``: 'export' (default) or 'symbolic_trace' to try first; the other is the
    fallback. Raises ``CaptureError`` naming the construct, the source line and the
    ``opaque=[...]`` remedy when both fail.
    """
    return trace_module(model, example_inputs, opaque=opaque, prefer=prefer)


__all__ = ["capture"]
