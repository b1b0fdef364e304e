"""The tiny models and seeded inputs the tensor- and context-parallel model tests build (importable as
`model_cases`); each test keeps its own sizes, mixer options and documents."""

import torch

from megamamba import MambaConfig


def lm_config(ssm: dict, d_model: int, **fields) -> MambaConfig:
    """Two layers of mixer `ssm` at width d_model over 37 tokens, unpadded; `fields` override the rest."""
    base = {"d_model": d_model, "n_layer": 2, "vocab_size": 37, "pad_vocab_size_multiple": 1}
    return MambaConfig(**{**base, **fields, "ssm_cfg": ssm})


def hybrid_config(pattern: str, ssm: dict, attn: dict, d_model: int, d_intermediate: int, **fields) -> MambaConfig:
    """A hybrid of Megatron-style `pattern` (M Mamba of `ssm`, * attention of `attn`, - MLP of d_intermediate
    channels) at width d_model over 37 tokens, unpadded; `fields` override the rest."""
    layers = len(pattern.replace("|", ""))
    return lm_config(
        ssm,
        d_model,
        n_layer=layers,
        hybrid_layer_pattern=pattern,
        attn_cfg=attn,
        d_intermediate=d_intermediate,
        **fields,
    )


def lm_inputs(cfg: MambaConfig, batch: int, seqlen: int, seed: int, documents=None):
    """Seeded (ids, labels, seq_idx): ids and labels (batch, seqlen) with row 0's first three labels masked
    (-100); seq_idx the document id of every position (int32, nested lists `documents`), or None."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seqlen), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (batch, seqlen), generator=gen)
    labels[0, :3] = -100
    seq_idx = None if documents is None else torch.tensor(documents, dtype=torch.int32)
    return ids, labels, seq_idx
