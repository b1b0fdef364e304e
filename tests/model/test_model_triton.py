"""The model on the Triton kernels (CPU: Triton's interpreter) computes what it computes on the reference ops.

The mixers hand the kernels views, as mamba_ssm does (slices of the fused in_proj output, the
transposed conv output), so this checks the kernels' stride handling as the model uses them,
forward and backward, with packed documents. Slow: the interpreter runs each program in Python.
"""
import pytest
import torch

import megamamba.kernels.triton as triton_ops
from megamamba import MambaLM


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def logits_and_grads(model, ids, seq_idx):
    model.zero_grad()
    logits = model(ids, seq_idx=seq_idx)
    (logits.float().square().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_triton_kernels_match_reference_in_the_model(tiny_config, layer, monkeypatch):
    if layer == "Mamba1" and not hasattr(triton_ops, "selective_scan"):
        pytest.skip("megamamba.kernels.triton has no selective_scan yet")
    seed = 51
    torch.manual_seed(seed)
    cfg = tiny_config(layer, n_layer=1)
    model = MambaLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    seq_idx = torch.zeros(2, 13, dtype=torch.int32)
    seq_idx[1, 6:] = 1
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "reference")
    ref, ref_grads = logits_and_grads(model, ids, seq_idx)
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    out, grads = logits_and_grads(model, ids, seq_idx)
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err <= 1e-5, f"{layer} seed {seed}: logits rel err {err:.2e}"
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
        err = rel_err(g, ref_grads[name])
        assert err <= 1e-4, f"{layer} seed {seed}: grad of {name} rel err {err:.2e}"
