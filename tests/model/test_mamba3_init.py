"""A Mamba-3 mixer starts as mamba_ssm 2.3.2.post1's `Mamba3` does: the same tensors, dtypes and constants
(biases 1, norms 1, D 1, MIMO x and o 1/R, z 1), dt in [dt_min, dt_max], and weight-decay marks."""

import pytest
import torch
import torch.nn.functional as F

import mamba_ssm_source
from megamamba import MambaConfig, MambaLM

SSM = {"layer": "Mamba3", "d_state": 8, "headdim": 6, "is_mimo": True, "mimo_rank": 3, "is_outproj_norm": True}
DRAWN = ("in_proj.weight", "out_proj.weight", "dt_bias")


def test_mamba3_mixer_initialises_as_mamba_ssm():
    cfg = MambaConfig(d_model=18, n_layer=2, vocab_size=37, ssm_cfg={**SSM, "dt_min": 0.01, "dt_max": 0.05})
    ours = MambaLM(cfg).backbone.layers[0].mixer
    with mamba_ssm_source.loaded() as (theirs, why):
        if theirs is None:
            pytest.skip(why)
        from mamba_ssm.modules import mamba3

        mamba3.mamba3_mimo_combined = object()  # its constructor only asserts the TileLang kernel imported
        options = {k: v for k, v in cfg.ssm_cfg.items() if k != "layer"}
        reference = mamba3.Mamba3(cfg.d_model, layer_idx=0, **options).state_dict()
    mine = ours.state_dict()
    assert {k: (v.shape, v.dtype) for k, v in mine.items()} == {k: (v.shape, v.dtype) for k, v in reference.items()}
    for name in sorted(set(mine) - set(DRAWN)):
        assert torch.equal(mine[name], reference[name]), name
    dt = F.softplus(mine["dt_bias"])
    assert dt.min() >= 0.01 * (1 - 1e-6) and dt.max() <= 0.05 * (1 + 1e-6)
    assert ours.dt_bias._no_weight_decay and ours.D._no_weight_decay
