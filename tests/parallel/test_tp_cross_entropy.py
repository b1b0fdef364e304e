"""vocab_parallel_cross_entropy on one rank against torch (the multi-rank checks are in test_tp_layers)."""

import pytest
import torch
import torch.nn.functional as F

from megamamba.parallel import TensorParallel, vocab_parallel_cross_entropy
from megamamba.testing.numerics import relative_error

SEED = 7


def _case(vocab=11, padding=3):
    gen = torch.Generator().manual_seed(SEED)
    logits = torch.randn(3, 5, vocab, generator=gen, dtype=torch.float64)
    target = torch.randint(0, vocab, (3, 5), generator=gen)
    target[0, 1:4] = -100
    padded = torch.cat([logits, torch.full((3, 5, padding), 40.0, dtype=torch.float64)], -1)
    return logits, padded, target


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_loss_and_logit_gradient_match_torch_with_padding_excluded(reduction):
    logits, padded, target = _case()
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.flatten(0, 1), target.flatten(), reduction=reduction)
    ref = ref.view(3, 5) if reduction == "none" else ref
    ref.backward(torch.ones_like(ref))
    ours_in = padded.float().requires_grad_()
    loss = vocab_parallel_cross_entropy(ours_in, target, TensorParallel(), vocab_size=11, reduction=reduction)
    loss.backward(torch.ones_like(loss))
    assert relative_error(loss, ref) <= 1e-6, f"seed {SEED}"
    assert relative_error(ours_in.grad[..., :11], ref_in.grad) <= 1e-6, f"seed {SEED}"
    assert torch.equal(ours_in.grad[..., 11:], torch.zeros(3, 5, 3))


def test_ignored_tokens_have_zero_loss_and_zero_gradient():
    _, padded, target = _case()
    logits = padded.float().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, target, TensorParallel(), vocab_size=11, reduction="none")
    loss.sum().backward()
    assert torch.equal(loss[0, 1:4], torch.zeros(3))
    assert torch.equal(logits.grad[0, 1:4], torch.zeros(3, 14))


def test_bfloat16_logits_give_a_float32_loss_and_bfloat16_gradient():
    logits, _, target = _case(padding=0)
    ours_in = logits.bfloat16().requires_grad_()
    loss = vocab_parallel_cross_entropy(ours_in, target, TensorParallel())
    loss.backward()
    ref = F.cross_entropy(logits.bfloat16().double().flatten(0, 1), target.flatten())
    assert loss.dtype == torch.float32 and ours_in.grad.dtype == torch.bfloat16
    assert relative_error(loss, ref) <= 1e-6


def test_mismatched_target_shape_is_refused():
    with pytest.raises(ValueError, match=r"target shape \(3, 4\) does not match logits \(3, 5, 11\)"):
        vocab_parallel_cross_entropy(torch.zeros(3, 5, 11), torch.zeros(3, 4, dtype=torch.long), TensorParallel())


def test_vocab_size_beyond_the_rows_is_refused():
    with pytest.raises(ValueError, match=r"vocab_size 12 must be in \(0, 11 rows x TP 1\]"):
        vocab_parallel_cross_entropy(
            torch.zeros(3, 11), torch.zeros(3, dtype=torch.long), TensorParallel(), vocab_size=12
        )
