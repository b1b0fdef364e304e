"""Tiny model configs shared by the model tests: odd sizes, Mamba-2 and Mamba-3 SISO with two groups, Mamba-3
MIMO of rank 3."""

import pytest

from megamamba import MambaConfig

TINY_SSM = {
    "Mamba1": {"layer": "Mamba1", "d_state": 5, "dt_rank": 3},
    "Mamba2": {"layer": "Mamba2", "d_state": 6, "headdim": 6, "ngroups": 2, "chunk_size": 8},
    "Mamba3": {"layer": "Mamba3", "d_state": 8, "headdim": 6, "ngroups": 2, "chunk_size": 8, "rope_fraction": 1.0},
    "Mamba3-MIMO": {
        "layer": "Mamba3",
        "d_state": 8,
        "headdim": 6,
        "is_mimo": True,
        "mimo_rank": 3,
        "chunk_size": 4,
        "is_outproj_norm": True,
    },
}


def tiny(layer: str, ssm: dict = None, **fields) -> MambaConfig:
    """d_model 18 (d_inner 36; Mamba-2 and -3: 6 heads of 6), 2 layers, vocab 37 (padded to 40)."""
    base = {"d_model": 18, "n_layer": 2, "vocab_size": 37, "pad_vocab_size_multiple": 8}
    return MambaConfig(**{**base, **fields, "ssm_cfg": {**TINY_SSM[layer], **(ssm or {})}})


@pytest.fixture
def tiny_config():
    return tiny
