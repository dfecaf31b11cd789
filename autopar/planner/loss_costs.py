"""The loss, charged to the layer producing the model's output (``LayerInfo.loss_bytes``:
its float32 logits at the captured batch): the memory cross-entropy holds and its passes
over the logits. The runtime hands the output to the user's loss in float32 whatever the
plan's precision (runtime/precision.py)."""

from __future__ import annotations

from cost_models.compute import roofline_s
from cost_models.hardware import Device
from cost_models.memory import Precision
from passes.records import CAPTURE_ACTIVATION_BYTES, LayerInfo

LOSS_SAVED_COPIES = 1
"""Float32 copies of the logits cross-entropy saves for backward (its log-probabilities)."""
PIPELINE_OUTPUT_COPIES = 1
"""More kept copies under pipelining: the last stage's ``PipelineStage`` holds its output (the
logits) in its forward cache from the micro-batch's forward to the end of its backward."""
LOSS_BACKWARD_COPIES = 2
"""More copies while the loss runs backward: the log-probabilities' and the logits' gradients."""


def loss_bytes(layer: LayerInfo, batch_shards: int, *, pipelined: bool = False
               ) -> tuple[float, float]:
    """(kept, transient) bytes of the loss on the layer producing the model's output, for
    one micro-batch (``LayerInfo.loss_bytes``: the float32 logits at the captured batch).

    Cross-entropy keeps its float32 log-probabilities, one copy of the logits, from its
    forward to its backward, which then holds their gradient and the logits' gradient too:
    two more copies, a transient (the loss's backward; the layer's own backward then holds
    the logits' gradient, one copy, in the place of the log-probabilities). Under
    pipelining the last stage also keeps the logits themselves until the micro-batch's
    backward ends (PIPELINE_OUTPUT_COPIES). Recomputation cannot free the kept copies (the
    loss runs outside the layer's checkpoint). The logits split with the batch shards
    (dp · m · cp); under TP they are whole on every rank: a lone Linear's ``colwise_gather``
    gathers its output (runtime/tensor_parallel.py), and a block's rowwise output is
    all-reduced, or gathered at the model's end under SP.
    """
    per_micro = layer.loss_bytes / batch_shards
    kept = LOSS_SAVED_COPIES + (PIPELINE_OUTPUT_COPIES if pipelined else 0)
    return kept * per_micro, LOSS_BACKWARD_COPIES * per_micro


LOSS_FWD_PASSES = 2
"""Float32 logits-sized tensors cross-entropy's forward reads or writes: log-softmax reads
the logits and writes the log-probabilities (the target gather is one element a row)."""
LOSS_BWD_PASSES = 4
"""And its backward: the log-probabilities' gradient is written (zeros, one element a row
scattered), then log-softmax's backward reads it and the log-probabilities and writes the
logits' gradient."""
LOSS_KERNELS = 2
"""Kernels each way: log-softmax and the target gather (forward), their backwards."""


def loss_s(layer: LayerInfo, batch_shards: int, prec: Precision, device: Device
           ) -> tuple[float, float]:
    """(forward, backward) seconds of the loss on the layer producing the model's output,
    one micro-batch: memory-bound passes over the float32 logits (``loss_bytes``) at
    ``Device.loss_efficiency`` times the memory bandwidth, plus the cast up to float32 and
    the gradient's cast back when the plan computes in lower precision
    (runtime/precision.py): read the low-precision tensor, write the other, at the
    bandwidth."""
    if not layer.loss_bytes:
        return 0.0, 0.0
    logits = layer.loss_bytes / batch_shards
    low = prec.activation_bytes / CAPTURE_ACTIVATION_BYTES
    cast = 0.0 if low >= 1 else (1 + low) * logits
    dtype, slower = prec.compute_dtype, 1 / device.loss_efficiency
    fwd = roofline_s(0.0, LOSS_FWD_PASSES * logits * slower + cast, LOSS_KERNELS, device, dtype)
    bwd = roofline_s(0.0, LOSS_BWD_PASSES * logits * slower + cast, LOSS_KERNELS, device, dtype)
    return fwd, bwd
