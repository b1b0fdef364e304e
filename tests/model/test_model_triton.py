"""The model on the Triton kernels (CPU: Triton's interpreter) computes what it computes on the reference ops.

The mixers hand the kernels views, as mamba_ssm does (slices of the fused in_proj output, the
transposed conv output), so this checks the kernels' stride handling as the model uses them,
forward and backward, with packed documents. Slow: the interpreter runs each program in Python.
"""

import pytest
import torch

from megamamba import MambaLM
from megamamba.optim import param_groups
from megamamba.testing.numerics import relative_error


def logits_and_grads(model, ids, seq_idx):
    model.zero_grad()
    logits = model(ids, seq_idx=seq_idx)
    (logits.float().square().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2", "Mamba3", "Mamba3-MIMO"])
def test_triton_kernels_match_reference_in_the_model(tiny_config, layer, monkeypatch):
    """Two blocks: the second's fused pre-norm adds the float32 residual."""
    seed = 51
    torch.manual_seed(seed)
    cfg = tiny_config(layer, n_layer=2)
    model = MambaLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    seq_idx = torch.zeros(2, 13, dtype=torch.int32)
    seq_idx[1, 6:] = 1
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "reference")
    ref, ref_grads = logits_and_grads(model, ids, seq_idx)
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    out, grads = logits_and_grads(model, ids, seq_idx)
    assert torch.isfinite(out).all()
    err = relative_error(out, ref)
    assert err <= 1e-5, f"{layer} seed {seed}: logits rel err {err:.2e}"
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
        err = relative_error(g, ref_grads[name])
        assert err <= 1e-4, f"{layer} seed {seed}: grad of {name} rel err {err:.2e}"


def train_losses(cfg, seed, steps):
    """Losses of `steps` AdamW steps on one fixed random batch, from the init of `seed`."""
    torch.manual_seed(seed)
    model = MambaLM(cfg)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    batch = torch.randint(0, cfg.vocab_size, (2, 17))
    losses = []
    for _ in range(steps):
        logits = model(batch[:, :-1])[..., : cfg.vocab_size]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


@pytest.mark.slow
@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_training_on_triton_kernels_follows_the_reference_loss_curve(tiny_config, layer, monkeypatch):
    seed, steps = 52, 3
    cfg = tiny_config(layer, n_layer=1)
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "reference")
    ref = train_losses(cfg, seed, steps)
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    out = train_losses(cfg, seed, steps)
    assert torch.isfinite(out).all(), out
    assert ref[-1] < ref[0], f"seed {seed}: the reference run did not learn: {ref.tolist()}"
    err = relative_error(out, ref)
    assert err <= 1e-4, f"{layer} seed {seed}: loss curve rel err {err:.2e}: {out.tolist()} vs {ref.tolist()}"
