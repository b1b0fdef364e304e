"""The router's losses equal their hand formulas (Megatron's switch load-balancing loss over the micro-batch or
per sequence, ST-MoE's z-loss) and reach the training loss's gradient, not its value; the expert-bias update
moves an unbalanced router towards balance."""

import math

import pytest
import torch

from megamamba.config import MoEOptions
from megamamba.model.loss import training_loss
from megamamba.model.moe_router import Router, forget_router_loads, update_expert_biases

EXPERTS, TOP_K = 6, 2


def router_of(seed=0, **options) -> Router:
    torch.manual_seed(seed)
    fields = {"num_experts": EXPERTS, "top_k": TOP_K, "ffn_hidden_size": 4, **options}
    return Router(5, MoEOptions(**fields), dtype=torch.float64)


def hand_switch_loss(probs: torch.Tensor) -> float:
    """E * sum_i f_i P_i over tokens `probs` (T, E): f_i the share of the T * k choices (each token's k best)
    that went to i, P_i the mean probability of i."""
    tokens = probs.shape[0]
    f = [0.0] * EXPERTS
    for row in probs.tolist():
        for i in sorted(range(EXPERTS), key=lambda i: (-row[i], i))[:TOP_K]:
            f[i] += 1 / (tokens * TOP_K)
    p = probs.mean(0).tolist()
    return EXPERTS * sum(f[i] * p[i] for i in range(EXPERTS))


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_the_micro_batch_load_balancing_loss_is_the_switch_formula(score_function):
    router = router_of(score_function=score_function, aux_loss_coeff=0.3, aux_loss_type="aux_loss")
    hidden = torch.randn(3, 4, 5, dtype=torch.float64)
    logits = hidden.reshape(-1, 5) @ router.weight.T
    probs = logits.softmax(-1) if score_function == "softmax" else logits.sigmoid() / logits.sigmoid().sum(-1, True)
    assert router(hidden).aux_loss.item() == pytest.approx(0.3 * hand_switch_loss(probs), rel=1e-12)


def test_the_sequence_load_balancing_loss_is_the_mean_of_each_sequence_s():
    router = router_of(score_function="softmax", aux_loss_coeff=0.3, aux_loss_type="seq_aux_loss")
    hidden = torch.randn(3, 4, 5, dtype=torch.float64)
    probs = (hidden @ router.weight.T).softmax(-1)
    want = 0.3 * sum(hand_switch_loss(p) for p in probs) / 3
    assert router(hidden).aux_loss.item() == pytest.approx(want, rel=1e-12)


def test_the_z_loss_is_the_mean_squared_log_sum_exp():
    router = router_of(z_loss_coeff=0.01)
    hidden = torch.randn(2, 3, 5, dtype=torch.float64)
    logits = (hidden.reshape(-1, 5) @ router.weight.T).tolist()
    want = 0.01 * sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / len(logits)
    assert router(hidden).aux_loss.item() == pytest.approx(want, rel=1e-12)


def test_no_router_loss_in_evaluation_or_with_zero_coefficients():
    router = router_of(aux_loss_coeff=0.1, z_loss_coeff=0.1)
    assert router_of()(torch.randn(1, 2, 5, dtype=torch.float64)).aux_loss is None
    router.eval()
    assert router(torch.randn(1, 2, 5, dtype=torch.float64)).aux_loss is None


def test_the_router_losses_add_to_the_gradient_of_the_training_loss_not_to_its_value():
    logits = torch.randn(1, 3, 8, requires_grad=True)
    aux = torch.tensor(0.25, requires_grad=True)
    labels = torch.tensor([[1, 2, 3]])
    plain = training_loss(logits, labels, 8)
    loss = training_loss(logits, labels, 8, aux_loss=aux * 3)
    assert loss.item() == plain.item()
    loss.backward()
    assert aux.grad.item() == 3.0


def test_the_expert_bias_update_moves_an_unbalanced_router_towards_balance():
    router = router_of(score_function="sigmoid", expert_bias=True, bias_update_rate=0.02)
    with torch.no_grad():
        router.weight[:2] += 1.0  # experts 0 and 1 take most tokens (the inputs are positive)
    generator = torch.Generator().manual_seed(3)
    imbalance = []
    for _ in range(40):
        hidden = torch.randn(4, 16, 5, dtype=torch.float64, generator=generator).abs()
        routing = router(hidden)
        routing.weights.sum().backward()
        counts = routing.tokens_per_expert.double()
        imbalance.append((counts.max() / counts.mean()).item())
        update_expert_biases(router)
    assert imbalance[0] == 3.0  # experts 0 and 1 take every token's two choices
    assert sum(imbalance[-10:]) / 10 < 1.8, imbalance


def test_the_bias_counts_each_micro_batch_once_in_the_backward_and_never_in_evaluation():
    router = router_of(expert_bias=True)
    hidden = torch.randn(2, 3, 5, dtype=torch.float64)
    with torch.no_grad():
        router(hidden)
    assert router.received is None
    first, second = router(hidden), router(hidden)
    (first.weights.sum() + second.weights.sum()).backward()
    assert router.received.tolist() == (first.tokens_per_expert + second.tokens_per_expert).tolist()
    update_expert_biases(router)
    assert router.received is None


def test_after_a_skipped_step_the_counts_are_forgotten_and_the_bias_stays():
    router = router_of(expert_bias=True)
    router(torch.randn(2, 3, 5, dtype=torch.float64)).weights.sum().backward()
    forget_router_loads(router)
    assert router.received is None
    update_expert_biases(router)
    assert router.e_score_correction_bias.abs().sum() == 0


def test_the_load_counts_the_copies_a_capacity_drops_and_the_router_losses():
    router = router_of(capacity_factor=0.5, aux_loss_coeff=0.1)
    router.train()
    routing = router(torch.randn(2, 6, 5, dtype=torch.float64))
    routing.weights.sum().backward()
    capacity = math.ceil(12 * TOP_K / EXPERTS * 0.5)
    assert router.load.dropped.item() == (routing.tokens_per_expert - capacity).clamp(min=0).sum().item() > 0
    assert router.load.aux_loss.item() == routing.aux_loss.item() and router.load.micro_batches == 1
