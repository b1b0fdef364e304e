"""With the kernels as custom ops, torch's FLOP counter sees a whole Mamba block: its count of one forward
equals the block's FLOPs per token (megamamba/model/flops.py) times the tokens, scans and conv included,
and a training step's count is three forwards."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megamamba import MambaConfig
from megamamba.model.flops import layer_flops
from megamamba.model.layers import build_layer
from megamamba.model.stream import Stream

CONFIGS = {
    "Mamba1": MambaConfig(
        d_model=18, n_layer=2, vocab_size=37, ssm_cfg={"layer": "Mamba1", "d_state": 5, "dt_rank": 3}
    ),
    "Mamba2": MambaConfig(
        d_model=18,
        n_layer=2,
        vocab_size=37,
        ssm_cfg={"layer": "Mamba2", "d_state": 6, "headdim": 6, "ngroups": 2, "chunk_size": 8},
    ),
}


@pytest.mark.parametrize("layer", CONFIGS)
def test_the_flop_counter_books_a_mamba_block_as_the_formula(layer):
    config, batch, seqlen = CONFIGS[layer], 2, 11
    block = build_layer(config, 1, seed=47)
    stream = torch.randn(batch, seqlen, config.d_model, generator=torch.Generator().manual_seed(47), requires_grad=True)
    with FlopCounterMode(display=False) as forward:
        out = block(Stream(stream)).hidden
    assert forward.get_total_flops() == batch * seqlen * layer_flops(config, seqlen)[1]
    with FlopCounterMode(display=False) as step:
        block(Stream(stream)).hidden.sum().backward()
    assert step.get_total_flops() == 3 * forward.get_total_flops()
    assert out.shape == stream.shape
