"""perf/moe_layer.py's torch peer is the MoE layer: at tiny dims on the CPU it matches the fp32 layer math
(`moe_layer_reference`) within bf16's tolerance, including experts no token picks and a token whose slots are
spread over every expert."""

from __future__ import annotations

import torch

from dispatch.ops.moe_layer import moe_layer_reference
from perf.moe_layer import LayerShape, make_routing, make_weights, torch_layer
from tests.helpers import assert_close


def test_torch_layer_matches_the_layer_math():
    torch.manual_seed(3)
    shape = LayerShape(hidden=64, inner=32, experts=6, top_k=2, weights=("bf16",))
    w = make_weights(shape, "bf16", "cpu")
    ids, weights = make_routing(9, shape, "cpu")
    ids[:, 0] = torch.arange(9) % 5  # expert 5 only ever in slot 1, maybe never: an empty group
    ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % 6, ids[:, 1])
    hidden = torch.randn(9, 64, dtype=torch.bfloat16)

    def act(h):
        return torch.nn.functional.silu(h[:, :32]) * h[:, 32:]

    want = moe_layer_reference(hidden, ids, weights, w["w1"], w["w2"], act)
    assert_close(torch_layer(hidden, ids, weights, w["w1"], w["w2"]), want, "torch grouped_mm layer",
                 torch.bfloat16)
