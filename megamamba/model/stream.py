"""The residual stream: what every layer of the model takes and returns.

mamba_ssm's blocks pass a pair (hidden, residual) and add it at the start of the next block; our
layers pass its sum s = hidden + residual, so a block is s -> s + mixer(norm(s)), the same sum and
roundings. The stream is float32 (at least) when residual_in_fp32, as mamba_ssm keeps the residual.
Beside it travels what every layer may read, the ids of packed documents, and what the training loss adds: the
mixture-of-experts blocks' router losses.
"""

from typing import NamedTuple, Optional

import torch


class Stream(NamedTuple):
    """`hidden`: (batch, seqlen, d_model), the token ids (batch, seqlen) entering the embedding, the normed
    hidden states after the final norm; a sequence shard under sequence parallelism, a context slice under
    CP. `seq_idx`: (batch, seqlen) int32 document ids of packed documents (every layer resets its state
    where the id changes), or None. `aux_loss`: the sum of the router losses of the blocks passed (a scalar the
    training loss adds), or None. A named tuple, so that DeepSpeed's ZeRO-3 hooks see the tensors in it."""

    hidden: torch.Tensor
    seq_idx: Optional[torch.Tensor] = None
    aux_loss: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, hidden: torch.Tensor, seq_idx: Optional[torch.Tensor] = None) -> "Stream":
        """The stream entering the model (or a pipeline stage): document ids as int32."""
        return cls(hidden, None if seq_idx is None else seq_idx.to(torch.int32))

    def carrying(self, hidden: torch.Tensor) -> "Stream":
        """The next layer's input: `hidden`, with the same documents and losses beside it."""
        return Stream(hidden, self.seq_idx, self.aux_loss)

    def adding_loss(self, loss: Optional[torch.Tensor]) -> "Stream":
        """This stream with `loss` (a scalar, or None: nothing) added to its aux_loss."""
        if loss is None:
            return self
        return self._replace(aux_loss=loss if self.aux_loss is None else self.aux_loss + loss)


def to_stream(tensor: torch.Tensor, residual_in_fp32: bool) -> torch.Tensor:
    """`tensor` in the stream's dtype: float32 or wider when residual_in_fp32, else its own."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32)) if residual_in_fp32 else tensor
