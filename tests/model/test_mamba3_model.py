"""Mamba-3 in the model: M blocks are Mamba-3 when ssm_cfg.layer says so (hybrids too), packed documents do
not see each other, and a TP size that does not divide its heads is refused by name."""

import pytest
import torch

from megamamba import MambaConfig, MambaLM
from megamamba.errors import LayoutError
from megamamba.model.layers import check_layout
from megamamba.model.mamba3 import Mamba3
from megamamba.testing.numerics import relative_error

SSM = {"layer": "Mamba3", "d_state": 8, "headdim": 6, "ngroups": 2, "chunk_size": 4}


def tiny(**fields) -> MambaConfig:
    return MambaConfig(**{"d_model": 18, "n_layer": 2, "vocab_size": 37, "ssm_cfg": SSM, **fields})


def test_m_blocks_of_a_hybrid_pattern_are_mamba3_when_ssm_cfg_says_so():
    cfg = tiny(n_layer=3, hybrid_layer_pattern="M-M", d_intermediate=20)
    model = MambaLM(cfg)
    assert cfg.block_kinds == ["mamba3", "mlp", "mamba3"]
    assert [type(b.mixer) for b in model.backbone.layers[::2]] == [Mamba3, Mamba3]


@pytest.mark.parametrize("mimo", [False, True])
def test_packed_documents_give_each_document_its_own_logits(mimo):
    seed = 31 + mimo
    torch.manual_seed(seed)
    model = MambaLM(tiny(ssm_cfg={**SSM, "is_mimo": mimo, "mimo_rank": 2})).eval()
    ids = torch.randint(0, 37, (1, 13))
    seq_idx = torch.tensor([[0] * 6 + [1] * 7], dtype=torch.int32)
    with torch.no_grad():
        packed = model(ids, seq_idx=seq_idx)
        alone = torch.cat([model(ids[:, :6]), model(ids[:, 6:])], dim=1)
    err = relative_error(packed, alone)
    assert err <= 1e-5, f"seed {seed}: packed vs separate documents rel err {err:.2e}"


def test_a_tp_size_not_dividing_the_heads_is_refused_by_name():
    with pytest.raises(
        LayoutError,
        match=r"^Mamba3 tensor parallelism splits the heads across ranks: nheads = 6 \(expand x d_model / headdim\) "
        r"is not divisible by tp=4$",
    ):
        check_layout(tiny(), 4)
