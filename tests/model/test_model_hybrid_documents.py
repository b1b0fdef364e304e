"""Packed documents in a hybrid: no token sees another document, through Mamba, attention and MLP layers;
and the CPU's attention masks equal the fused paths CUDA takes (FlexAttention's block mask, SDPA's causal).
"""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from megamamba import MambaConfig, MambaLM
from megamamba.model.causal_attention import causal_attention, document_block_mask

SEED = 47
ATTN = {"num_heads": 6, "num_heads_kv": 2, "head_dim": 4, "rotary_emb_dim": 2, "causal": True}
LENGTHS = [[5, 8, 6], [19]]  # row 0: three documents; row 1: one


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def seq_idx_of(lengths):
    return torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths]).int()


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_changing_other_documents_leaves_a_documents_logits_unchanged(layer):
    """Row 0's middle document keeps its logits (to 1e-12 in float64) when the tokens before and after
    it change, through a pattern with every layer kind; without seq_idx the same change moves them."""
    ssm = {"Mamba1": {"layer": "Mamba1", "d_state": 5, "dt_rank": 3},
           "Mamba2": {"layer": "Mamba2", "d_state": 6, "headdim": 6, "ngroups": 2, "chunk_size": 4}}[layer]
    cfg = MambaConfig(d_model=18, n_layer=5, vocab_size=37, ssm_cfg=ssm, hybrid_layer_pattern="M*-*M",
                      attn_cfg=ATTN, d_intermediate=22)
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
    err = rel_err(after[0, middle], before[0, middle])
    assert err <= 1e-12, f"{layer} seed {SEED}: the middle document moved by {err:.2e}"
    assert torch.equal(after[1], before[1])
    assert rel_err(unpacked_after[0, middle], unpacked_before[0, middle]) > 1e-3


def heads(seed, batch, lq, lk, heads_q=6, heads_kv=2, head_dim=5):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, lq, heads_q, head_dim, generator=gen, dtype=torch.float64),
            torch.randn(batch, lk, heads_kv, head_dim, generator=gen, dtype=torch.float64),
            torch.randn(batch, lk, heads_kv, head_dim, generator=gen, dtype=torch.float64))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("lengths,q_start", [(LENGTHS, 0), (LENGTHS, 7), ([[100, 90, 50, 60], [300]], 130)],
                         ids=["whole_sequence", "later_slice", "many_tiles"])
def test_cpu_boolean_mask_equals_flex_attention_block_mask(lengths, q_start):
    """The CPU path against CUDA's: FlexAttention with `document_block_mask`, run eagerly here; queries
    from q_start (a context-parallel slice) against every key, documents crossing the slice and the
    128-position tiles (full tiles of row 1 read unmasked), row 0's ids reused (0, 1, 0, 1: four
    documents)."""
    ids = seq_idx_of(lengths) % 2
    lk = ids.shape[1]
    q, k, v = heads(SEED, 2, lk - q_start, lk)
    out = causal_attention(q, k, v, 0.41, q_start=q_start, ids=ids)
    mask = document_block_mask(ids, q_start)
    ref = flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=mask, scale=0.41,
                         enable_gqa=True).transpose(1, 2)
    err = rel_err(out, ref)
    assert torch.isfinite(out).all() and err <= 1e-12, f"{lengths} q_start {q_start} seed {SEED}: rel err {err:.2e}"


@pytest.mark.parametrize("q_start", [0, 7], ids=["whole_sequence", "later_slice"])
def test_no_documents_equals_a_boolean_causal_mask(q_start):
    """is_causal (from position 0) and the lower-right causal bias (a later slice) equal SDPA with an
    explicit mask key <= query position, grouped-query heads repeated."""
    lk = 19
    q, k, v = heads(SEED + 1, 2, lk - q_start, lk)
    out = causal_attention(q, k, v, q_start=q_start)
    mask = torch.arange(lk)[None, :] <= torch.arange(q_start, lk)[:, None]
    k, v = (t.repeat_interleave(3, dim=2) for t in (k, v))
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask).transpose(1, 2)
    err = rel_err(out, ref)
    assert torch.isfinite(out).all() and err <= 1e-12, f"q_start {q_start} seed {SEED + 1}: rel err {err:.2e}"
