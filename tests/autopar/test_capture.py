"""Capture: zoo models and a Hugging Face model to fx graphs on meta; clear errors otherwise."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from reference import hf_gpt2

from autopar.capture import capture
from autopar.errors import CaptureError
from autopar.zoo import get_model
from passes import meta_keys

CALLS = ("call_function", "call_method", "call_module")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _module_paths(gm: torch.fx.GraphModule) -> set[str]:
    paths = set()
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op in CALLS and stack:
            paths.add(str(list(stack.values())[-1][0]))
    return paths


@pytest.fixture(autouse=True)
def _quiet_export_logs():
    # torch.export logs the graph it gave up on; the tests check our message instead.
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def test_captures_gpt_tiny_with_export_keeping_module_paths():
    spec = get_model("gpt-tiny")
    model = spec.build("cpu")
    gm = capture(model, spec.example_inputs(2, 16, device="cpu"))
    assert gm.meta[meta_keys.CAPTURE].method == "export"
    modules = dict(model.named_modules())
    paths = _module_paths(gm)
    assert {"wte", "h.0.attn.q_proj", "h.1.mlp.fc_out", "lm_head"} <= paths
    assert paths <= set(modules)  # names of the original model, not export's mangled ones


def test_symbolic_trace_can_be_preferred():
    spec = get_model("gpt-tiny")
    gm = capture(spec.build("meta"), spec.example_inputs(2, 16), prefer="symbolic_trace")
    assert gm.meta[meta_keys.CAPTURE].method == "symbolic_trace"
    assert "h.1.attn.k_proj" in _module_paths(gm)


def test_captures_gpt3_175b_on_meta_without_allocating_weights():
    spec = get_model("gpt3-175b")
    before = _rss_bytes()
    model = spec.build("meta")
    gm = capture(model, spec.example_inputs(8, 2048))
    growth = _rss_bytes() - before
    assert growth < 500 * 2**20, f"RSS grew by {growth / 2**20:.0f} MiB"
    assert gm.meta[meta_keys.CAPTURE].method == "export"
    assert "h.95.mlp.fc_in" in _module_paths(gm)


def test_captures_hugging_face_gpt2_from_config():
    model = hf_gpt2()
    gm = capture(model, (torch.randint(0, 128, (2, 16)),))
    assert gm.meta[meta_keys.CAPTURE].method == "export"
    paths = _module_paths(gm)
    assert {"transformer.wte", "transformer.h.0.attn.c_attn", "transformer.h.1.mlp.c_proj",
            "lm_head"} <= paths
    assert paths <= {name for name, _ in model.named_modules()}


def test_hugging_face_cache_output_is_explained():
    with pytest.raises(CaptureError, match="use_cache=False"):
        capture(hf_gpt2(use_cache=True), (torch.randint(0, 128, (2, 16)),))


class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: neither export nor symbolic_trace can capture it
            return self.fc(x)
        return x


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.gate = _Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.inp(x))


def test_uncapturable_model_names_construct_line_and_opaque_remedy():
    with pytest.raises(CaptureError) as info:
        capture(_Net(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert f"{__file__}:" in msg and "if x.sum() > 0:" in msg
    assert "control flow" in msg
    assert "opaque=['gate']" in msg


def test_opaque_module_is_captured_as_one_call():
    gm = capture(_Net(), (torch.randn(2, 4),), opaque=["gate"])
    assert gm.meta[meta_keys.CAPTURE].method == "symbolic_trace"
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert calls == ["inp", "gate"]


def test_unknown_opaque_path_is_rejected_with_valid_names():
    with pytest.raises(ValueError, match="not submodule paths.*inp"):
        capture(_Net(), (torch.randn(2, 4),), opaque=["nope"])
