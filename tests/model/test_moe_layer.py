"""The mixture-of-experts mixer equals a float64 per-expert-loop reference (tests/model/moe_reference.py):
outputs and every gradient, the router's included, for softmax and sigmoid + bias routing, with groups and
with ties; and the grouped GEMM path (torch._grouped_mm, float32) agrees with it to float32 rounding."""

import pytest
import torch

from megamamba.config import MoEOptions
from megamamba.model.moe import MoE
from megamamba.model.moe_experts import _grouped_mm_serves
from moe_reference import reference_choices, reference_moe

D_MODEL = 8
CASES = {
    "softmax": dict(score_function="softmax", activation="gated_silu"),
    "softmax_unnormalised_scaled": dict(score_function="softmax", norm_topk_prob=False, routed_scaling_factor=2.5),
    "sigmoid_bias": dict(score_function="sigmoid", expert_bias=True, activation="relu2", routed_scaling_factor=1.7),
    "sigmoid_bias_groups": dict(
        score_function="sigmoid", expert_bias=True, activation="relu2", n_group=4, topk_group=2, top_k=3
    ),
    "softmax_groups": dict(score_function="softmax", n_group=2, topk_group=1),
}


def moe_of(dtype=torch.float64, seed=0, **options) -> MoE:
    fields = {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 4, "shared_expert_ffn_hidden_size": 4, **options}
    torch.manual_seed(seed)
    moe = MoE(D_MODEL, MoEOptions(**fields), dtype=dtype)
    if moe.gate.e_score_correction_bias is not None:
        moe.gate.e_score_correction_bias.copy_(torch.randn(8, dtype=dtype) * 0.3)
    return moe


def outputs_and_gradients(moe: MoE, hidden: torch.Tensor, forward) -> list:
    """The output and the gradients of a fixed random projection of it: input, then every parameter."""
    hidden = hidden.detach().clone().requires_grad_(True)
    out = forward(moe, hidden)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    parameters = [p for p in moe.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * cotangent.to(out.dtype)).sum(), [hidden, *parameters])
    return [out, *grads]


def assert_close(got: list, want: list, tol: float) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", list(CASES))
def test_the_layer_equals_the_per_expert_reference_in_float64(case):
    moe = moe_of(**CASES[case])
    hidden = torch.randn(2, 6, D_MODEL, dtype=torch.float64)
    got = outputs_and_gradients(moe, hidden, lambda m, h: m(h))
    want = outputs_and_gradients(moe, hidden, reference_moe)
    assert_close(got, want, 1e-6)


def test_equal_scores_go_to_the_lower_expert_index():
    moe = moe_of(score_function="sigmoid", expert_bias=True, n_group=4, topk_group=2, top_k=3)
    with torch.no_grad():
        moe.gate.weight[1] = moe.gate.weight[0]  # experts 0 and 1, and 4 and 5, score alike
        moe.gate.weight[5] = moe.gate.weight[4]
        moe.gate.e_score_correction_bias.zero_()
    hidden = torch.randn(3, 5, D_MODEL, dtype=torch.float64)
    routing = moe.gate(hidden)
    scores = (hidden.reshape(-1, D_MODEL) @ moe.gate.weight.T).sigmoid()
    assert routing.experts.tolist() == reference_choices(scores, moe.options, None)
    for chosen in routing.experts.tolist():
        assert not ({1, 5} & set(chosen)) - {e + 1 for e in chosen}, "a tied expert won over its lower twin"
    got = outputs_and_gradients(moe, hidden, lambda m, h: m(h))
    assert_close(got, outputs_and_gradients(moe, hidden, reference_moe), 1e-6)


def test_all_scores_equal_route_every_token_to_the_first_experts():
    moe = moe_of(score_function="softmax")
    with torch.no_grad():
        moe.gate.weight.zero_()
    routing = moe.gate(torch.randn(2, 4, D_MODEL, dtype=torch.float64))
    assert routing.experts.tolist() == [[0, 1]] * 8


@pytest.mark.parametrize("case", ["softmax", "sigmoid_bias_groups"])
def test_the_grouped_gemm_path_agrees_with_the_reference_to_float32_rounding(case):
    moe = moe_of(dtype=torch.float32, **CASES[case])
    hidden = torch.randn(2, 6, D_MODEL)
    assert _grouped_mm_serves(hidden.reshape(-1, D_MODEL), moe.experts.up_proj), "the float32 path is not grouped"
    got = outputs_and_gradients(moe, hidden, lambda m, h: m(h))
    want = outputs_and_gradients(moe.double(), hidden.double(), reference_moe)
    assert_close(got, want, 2e-5)


def test_a_capacity_drops_the_lowest_weights_beyond_it():
    moe = moe_of(score_function="softmax", capacity_factor=0.5, shared_expert_ffn_hidden_size=0)
    hidden = torch.randn(2, 6, D_MODEL, dtype=torch.float64)
    routing = moe.gate(hidden)
    capacity = 2  # ceil(12 tokens x 2 / 8 experts x 0.5)
    kept = torch.zeros_like(routing.weights)
    for e in range(8):
        slots = (routing.experts == e).nonzero().tolist()
        slots.sort(key=lambda s: (-routing.weights[s[0], s[1]].item(), s[0] * 2 + s[1]))
        for t, c in slots[:capacity]:
            kept[t, c] = 1
    tokens = hidden.reshape(-1, D_MODEL)
    one_row = [torch.bincount(routing.experts[t, c : c + 1], minlength=8) for t in range(12) for c in range(2)]
    expert_outputs = {(t, c): moe.experts(tokens[t : t + 1], one_row[2 * t + c]) for t in range(12) for c in range(2)}
    want = torch.stack(
        [sum(kept[t, c] * routing.weights[t, c] * expert_outputs[t, c][0] for c in range(2)) for t in range(12)]
    )
    torch.testing.assert_close(moe(hidden).reshape(12, D_MODEL), want, rtol=1e-9, atol=1e-12)
