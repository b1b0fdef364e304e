"""Tensor-parallel layouts of hybrids without processes: refusals naming the values, one rank's shards.

As tests/parallel/test_tp_model_layout.py, one rank of a larger group is built with a stand-in group
object (`model_checks.rank_of`: building communicates nothing).
"""

import pytest

from megamamba import MambaConfig, MambaLM
from megamamba.model.attention import Attention
from megamamba.parallel.tensor.model_layout import LayoutError
from model_checks import parameters_not_their_slices, rank_of

MAMBA2 = {"layer": "Mamba2", "d_state": 6, "headdim": 8, "ngroups": 1, "chunk_size": 8}  # d_inner 64: 8 heads


def hybrid(attn=None, pattern="M*-", d_intermediate=24, **fields):
    attn = {"num_heads": 8, "num_heads_kv": 2, "head_dim": 6, "causal": True, **(attn or {})}
    return MambaConfig(
        d_model=32,
        n_layer=len(pattern),
        vocab_size=37,
        pad_vocab_size_multiple=1,
        ssm_cfg=MAMBA2,
        hybrid_layer_pattern=pattern,
        attn_cfg=attn,
        d_intermediate=d_intermediate,
        **fields,
    )


@pytest.mark.parametrize(
    "cfg,tp_size,message",
    [
        (hybrid({"num_heads": 6, "num_heads_kv": 3}), 4, r"query heads.*num_heads = 6 is not divisible by TP = 4"),
        (
            hybrid({"num_heads": 12, "num_heads_kv": 6}),
            4,
            r"splits the key/value heads .* or replicates them .*num_heads_kv = 6 does neither at TP = 4",
        ),
        (hybrid(d_intermediate=36), 8, r"MLP .*hidden channels.*d_intermediate = 36 is not divisible by TP = 8"),
        (
            MambaConfig(
                d_model=32, n_layer=2, vocab_size=37, ssm_cfg=MAMBA2, d_intermediate=36, mlp_activation="squared_relu"
            ),
            8,
            r"d_intermediate = 36 is not divisible by TP = 8",
        ),
    ],
    ids=["heads", "kv_heads", "mlp_layer_width", "mlp_inside_blocks_width"],
)
def test_layouts_that_cannot_split_are_refused_naming_the_values(cfg, tp_size, message):
    with pytest.raises(LayoutError, match=message):
        MambaLM(cfg, tp=rank_of(tp_size))


def test_the_attention_mixer_refuses_a_layout_on_its_own():
    with pytest.raises(LayoutError, match=r"num_heads = 6 is not divisible by TP = 4"):
        Attention(32, hybrid({"num_heads": 6, "num_heads_kv": 3}).attention_options, tp=rank_of(4))


@pytest.mark.parametrize(
    "tp_size,rank,heads,kv_heads,own_kv_head", [(2, 1, 4, 1, None), (4, 3, 2, 1, 1), (8, 2, 1, 1, 0)]
)
def test_attention_keeps_its_query_heads_and_their_key_value_head(tp_size, rank, heads, kv_heads, own_kv_head):
    """8 query heads of 6, 2 key/value heads: split at TP 2, replicated at TP 4 and 8 (rank r's queries
    read head r // (TP / 2))."""
    mixer = MambaLM(hybrid(), tp=rank_of(tp_size, rank)).backbone.layers[1].mixer
    assert (mixer.num_heads, mixer.kv_heads, mixer.own_kv_head) == (heads, kv_heads, own_kv_head)
    replicated = mixer.in_proj.weight_replicated
    if own_kv_head is None:
        assert mixer.in_proj.weight.shape == ((4 + 2) * 6, 32) and replicated is None
    else:
        assert mixer.in_proj.weight.shape == (heads * 6, 32) and replicated.shape == (2 * 2 * 6, 32)
    assert mixer.out_proj.weight.shape == (32, heads * 6)


@pytest.mark.parametrize(
    "cfg",
    [
        hybrid(),
        hybrid({"num_heads_kv": 1}, pattern="*M-", mlp_activation="squared_relu"),
        MambaConfig(
            d_model=32,
            n_layer=2,
            vocab_size=37,
            ssm_cfg=MAMBA2,
            attn_layer_idx=[1],
            attn_cfg={"num_heads": 4, "causal": True},
            d_intermediate=40,
        ),
    ],
    ids=["gqa_pattern", "mqa_squared_relu", "mlp_inside_blocks"],
)
@pytest.mark.parametrize("tp_size", [2, 4])
def test_every_ranks_parameters_are_its_slices_of_the_single_device_init(cfg, tp_size):
    for rank in range(tp_size):
        assert parameters_not_their_slices(cfg, tp_size, rank, seed=7) == [], f"TP {tp_size} rank {rank}"
