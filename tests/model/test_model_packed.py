"""Packed documents: with seq_idx, no document sees another (conv and SSM state reset in every layer)."""

import pytest
import torch

from megamamba import MambaLM
from megamamba.testing.numerics import relative_error


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_each_packed_document_matches_running_it_alone(tiny_config, layer):
    seed = 21
    torch.manual_seed(seed)
    cfg = tiny_config(layer)
    model = MambaLM(cfg).eval()
    # Row 0: documents of 7, 11 and 3 tokens; row 1: one document of 21 tokens.
    lengths = [[7, 11, 3], [21]]
    ids = torch.randint(0, cfg.vocab_size, (2, 21))
    seq_idx = torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths])
    with torch.no_grad():
        packed = model(ids, seq_idx=seq_idx.to(torch.int32))
        unpacked = model(ids)
        for row, ls in enumerate(lengths):
            start = 0
            for n in ls:
                alone = model(ids[row : row + 1, start : start + n])
                err = relative_error(packed[row : row + 1, start : start + n], alone)
                assert err <= 1e-5, f"{layer} seed {seed}: row {row} document at {start}: rel err {err:.2e}"
                start += n
    assert torch.isfinite(packed).all()
    # Without seq_idx the later documents see the earlier ones, so the check above can fail.
    assert 1e-3 < relative_error(unpacked[0, 7:18], packed[0, 7:18]) < float("inf")
    assert relative_error(unpacked[1], packed[1]) <= 1e-5


def test_seq_idx_of_another_shape_is_refused(tiny_config):
    model = MambaLM(tiny_config("Mamba2"))
    with pytest.raises(ValueError, match="seq_idx shape"):
        model(torch.zeros(2, 5, dtype=torch.long), seq_idx=torch.zeros(2, 4, dtype=torch.int32))
