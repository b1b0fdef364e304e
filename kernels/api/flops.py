"""FLOPs of the kernels, a multiply-add as 2: the formulas FlopCounterMode counts our ops by, and the
scans' and the conv's terms of the model's FLOPs per token (megamamba/model/flops.py).

`tokens` is batch x seqlen. Norms, gates and softplus are elementwise and count 0. A backward op
counts twice its forward, training's convention. Where the formulas come from: docs/code.md.
"""

BACKWARD = 2  # FLOPs of an op's backward per FLOP of its forward


def ssd_flops(tokens: int, seqlen: int, nheads: int, headdim: int, ngroups: int, dstate: int, chunk_size: int) -> int:
    """Mamba-2's chunked scan, forward, chunks of Q = min(chunk_size, seqlen) positions: C B^T inside a
    chunk (2 Q N per group), its product with x (2 Q P per head), the chunk states B^T x and the output
    from the passed states C h (2 N P per head each); the Q x Q blocks counted whole, as the matmuls run
    them."""
    q = min(chunk_size, seqlen)
    width = nheads * headdim
    return tokens * (2 * q * dstate * ngroups + 2 * q * width + 4 * dstate * width)


def mamba3_scan_flops(
    tokens: int, seqlen: int, nheads: int, rank: int, headdim: int, dstate: int, chunk_size: int
) -> int:
    """Mamba-3's scan, forward, as the SSD above with one group per head and R = rank queries and keys per
    token (the trapezoid's previous-token term folded into the token's own key): Ĉ B̂^T inside a chunk
    (2 Q N R^2 per head), its product with x (2 Q P R^2), the chunk states and the output from the passed
    states (2 N P R each)."""
    q = min(chunk_size, seqlen)
    return tokens * nheads * rank * (2 * q * rank * (dstate + headdim) + 4 * dstate * headdim)


def selective_scan_flops(tokens: int, dim: int, dstate: int) -> int:
    """Mamba-1's selective scan, forward: 9 per (channel, state) and step (Gu & Dao, 2023, sec. 3.3:
    discretise A and B, update the state, read it out with C)."""
    return 9 * tokens * dim * dstate


def conv_flops(tokens: int, dim: int, width: int) -> int:
    """The depthwise causal conv, forward: one multiply-add per channel and tap."""
    return 2 * tokens * dim * width
