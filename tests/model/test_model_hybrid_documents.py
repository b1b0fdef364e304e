"""Packed documents in a hybrid: no token sees another document, through Mamba, attention and MLP layers.

The attention masks alone (the CPU's boolean mask, FlexAttention's block mask, the causal paths) are
tests/model/test_causal_attention.py's.
"""

import pytest
import torch

from megamamba import MambaConfig, MambaLM
from megamamba.testing.numerics import relative_error

SEED = 47
ATTN = {"num_heads": 6, "num_heads_kv": 2, "head_dim": 4, "rotary_emb_dim": 2, "causal": True}
LENGTHS = [[5, 8, 6], [19]]  # row 0: three documents; row 1: one


def seq_idx_of(lengths):
    return torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths]).int()


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_changing_other_documents_leaves_a_documents_logits_unchanged(layer):
    """Row 0's middle document keeps its logits (to 1e-12 in float64) when the tokens before and after
    it change, through a pattern with every layer kind; without seq_idx the same change moves them."""
    ssm = {
        "Mamba1": {"layer": "Mamba1", "d_state": 5, "dt_rank": 3},
        "Mamba2": {"layer": "Mamba2", "d_state": 6, "headdim": 6, "ngroups": 2, "chunk_size": 4},
    }[layer]
    cfg = MambaConfig(
        d_model=18,
        n_layer=5,
        vocab_size=37,
        ssm_cfg=ssm,
        hybrid_layer_pattern="M*-*M",
        attn_cfg=ATTN,
        d_intermediate=22,
    )
    torch.manual_seed(SEED)
    model = MambaLM(cfg).double().eval()
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=gen)
    changed = ids.clone()
    changed[0, :5] = torch.randint(0, cfg.vocab_size, (5,), generator=gen)
    changed[0, 13:] = torch.randint(0, cfg.vocab_size, (6,), generator=gen)
    seq_idx = seq_idx_of(LENGTHS)
    middle = slice(5, 13)
    with torch.no_grad():
        before, after = model(ids, seq_idx=seq_idx), model(changed, seq_idx=seq_idx)
        unpacked_before, unpacked_after = model(ids), model(changed)
    assert torch.isfinite(before).all()
    err = relative_error(after[0, middle], before[0, middle])
    assert err <= 1e-12, f"{layer} seed {SEED}: the middle document moved by {err:.2e}"
    assert torch.equal(after[1], before[1])
    assert 1e-3 < relative_error(unpacked_after[0, middle], unpacked_before[0, middle]) < float("inf")
