"""The run's context-parallel checks for hybrids: attention needs no conv halo, only equal slices (split over
TP too with sequence parallelism); the Mamba layers' conv halo rule applies only where a Mamba layer is."""

import re

import pytest

from megamamba.pipelines.config.layout import LayoutError, check_run, resolve_layout
from model_cases import hybrid_config

BATCH = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
MAMBA2 = {"layer": "Mamba2", "d_state": 4, "headdim": 4, "chunk_size": 4}  # d_conv 4: a 3-token halo
ATTENTION = {"num_heads": 4, "num_heads_kv": 2, "causal": True}


def check(pattern, seq_length, cp, tp=1, sequence_parallel=False):
    layout = resolve_layout(cp * tp, tp, 1, BATCH, cp)
    check_run(layout, BATCH, hybrid_config(pattern, MAMBA2, ATTENTION, 16, 24), seq_length, sequence_parallel, None)


def test_attention_and_mlp_layers_take_slices_shorter_than_a_conv_halo():
    check("*-*-", 8, cp=4)  # slices of 2 tokens


def test_a_mamba_layer_beside_attention_keeps_the_conv_halo_rule():
    with pytest.raises(
        LayoutError,
        match=re.escape("d_conv - 1 = 3 tokens to the next rank: slices of seqlen 8 / CP 4 = 2 are shorter"),
    ):
        check("M*-", 8, cp=4)


@pytest.mark.parametrize(
    "seq_length, tp, sequence_parallel, words",
    [
        (30, 1, False, "seqlen = 30 is not divisible by CP 4"),
        (36, 2, True, "seqlen = 36 is not divisible by CP 4 x TP 2 (sequence parallelism) = 8"),
    ],
)
def test_attention_alone_still_needs_equal_slices(seq_length, tp, sequence_parallel, words):
    with pytest.raises(LayoutError, match=re.escape(words)):
        check("*-", seq_length, cp=4, tp=tp, sequence_parallel=sequence_parallel)
