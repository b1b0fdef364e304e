"""With the packer's document ids as seq_idx, a document's logits do not depend on what was packed before it."""

import numpy as np
import pytest
import torch

from megamamba import MambaConfig, MambaLM
from megamamba.data.packing import segment_ids
from megamamba.testing.numerics import relative_error

EOD = 0
SSM = {
    "Mamba1": {"layer": "Mamba1", "d_state": 5, "dt_rank": 3},
    "Mamba2": {"layer": "Mamba2", "d_state": 6, "headdim": 6, "ngroups": 2, "chunk_size": 8},
}


def packed(before: list, document: list):
    """One row: the previous document, its end-of-document token, then `document`; and its seq_idx."""
    tokens = before + [EOD] + document
    ids = segment_ids(np.array([len(before)]), len(tokens))
    return torch.tensor([tokens]), torch.from_numpy(ids)[None], len(before)


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_document_logits_do_not_depend_on_the_document_before(layer):
    seed = 7
    torch.manual_seed(seed)
    config = MambaConfig(d_model=18, n_layer=2, vocab_size=37, ssm_cfg=SSM[layer])
    model = MambaLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    document = torch.randint(1, 37, (19,), generator=gen).tolist()
    first = torch.randint(1, 37, (13,), generator=gen).tolist()
    second = torch.randint(1, 37, (6,), generator=gen).tolist()  # another length: the document sits elsewhere
    (x1, s1, at1), (x2, s2, at2) = packed(first, document), packed(second, document)
    with torch.no_grad():
        with_reset = model(x1, seq_idx=s1)[0, at1:], model(x2, seq_idx=s2)[0, at2:]
        without = model(x1)[0, at1:], model(x2)[0, at2:]
    assert torch.isfinite(with_reset[0]).all() and torch.isfinite(with_reset[1]).all()
    err = relative_error(with_reset[0], with_reset[1])
    assert err <= 1e-5, f"{layer} seed {seed}: document logits depend on the previous document (rel err {err:.2e})"
    leak = relative_error(without[0], without[1])
    assert 1e-3 < leak < float("inf"), (
        f"{layer} seed {seed}: without seq_idx the previous document should matter (rel {leak:.2e})"
    )
