"""The chunked loss (megamamba.model.chunked_cross_entropy, behind lm_loss on one device) against
F.cross_entropy on the sliced float32 logits: loss and gradient within 1e-6 relative."""

import pytest
import torch
import torch.nn.functional as F

from megamamba.model import chunked_cross_entropy as cross_entropy
from megamamba.model.loss import lm_loss
from megamamba.testing.numerics import relative_error


def loss_and_grad(fn, logits, labels):
    leaf = logits.detach().clone().requires_grad_()
    loss = fn(leaf, labels)
    loss.backward(torch.tensor(1.7, dtype=loss.dtype))
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_elements", [45, 1 << 25])  # 1 row per chunk (odd), one chunk
def test_matches_cross_entropy_on_sliced_float32_logits(dtype, chunk_elements, monkeypatch):
    monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(5)
    vocab, padded = 37, 40
    logits = (3 * torch.randn(3, 11, padded, generator=gen)).to(dtype)
    logits[..., vocab:] = 50.0  # padded columns that would dominate if not excluded
    labels = torch.randint(0, vocab, (3, 11), generator=gen)
    labels[0, :4] = -100
    loss, grad = loss_and_grad(lambda x, y: lm_loss(x, y, vocab), logits, labels)
    ref, ref_grad = loss_and_grad(
        lambda x, y: F.cross_entropy(x[..., :vocab].flatten(0, -2).float(), y.flatten()), logits, labels
    )
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert relative_error(loss, ref) <= 1e-6, (loss, ref)
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # bf16: a few roundings may differ by an ulp
    assert relative_error(grad, ref_grad) <= tol, relative_error(grad, ref_grad)
    assert (grad[..., vocab:] == 0).all() and (grad[0, :4] == 0).all()


def test_all_ignored_gives_nan_as_cross_entropy_does():
    logits = torch.randn(2, 5, requires_grad=True)
    loss = cross_entropy.chunked_cross_entropy(logits, torch.full((2,), -100), 5)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits, torch.full((2,), -100)))


def test_shape_and_vocab_are_checked():
    with pytest.raises(ValueError, match=r"labels shape \(3,\)"):
        cross_entropy.chunked_cross_entropy(torch.randn(2, 5), torch.zeros(3, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="vocab_size 6"):
        cross_entropy.chunked_cross_entropy(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), 6)
