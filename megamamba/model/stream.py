"""The residual stream: what every layer of the model takes and returns.

mamba_ssm's blocks pass a pair (hidden, residual) and add it at the start of the next block; our
layers pass its sum s = hidden + residual, so a block is s -> s + mixer(norm(s)), the same sum and
roundings. The stream is float32 (at least) when residual_in_fp32, as mamba_ssm keeps the residual.
With packed documents it travels with their ids: the pair (stream, seq_idx).
"""

from typing import Optional

import torch


def to_stream(tensor: torch.Tensor, residual_in_fp32: bool) -> torch.Tensor:
    """`tensor` in the stream's dtype: float32 or wider when residual_in_fp32, else its own."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32)) if residual_in_fp32 else tensor


def unpack(x) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A layer input -> (tensor, seq_idx as int32 or None): a tensor alone or the pair (tensor, seq_idx)."""
    if isinstance(x, torch.Tensor):
        return x, None
    tensor, seq_idx = x
    return tensor, seq_idx.to(torch.int32)


def pack(tensor: torch.Tensor, seq_idx: Optional[torch.Tensor]):
    """A layer output for the next layer: the tensor, with seq_idx beside it when there is one."""
    return tensor if seq_idx is None else (tensor, seq_idx)
