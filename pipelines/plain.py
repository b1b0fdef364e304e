"""The training module for the plain DeepSpeed engine (pipeline size 1, any ZeRO stage).

It holds a `MambaLM`'s own `backbone` and `lm_head`, so its parameter names are mamba_ssm's, and
runs the same layer list as the pipeline ([embedding, blocks, final norm, head], see
`pipelines.layers`) with the same math; runs of `checkpoint_interval` consecutive layers are
recomputed in the backward, as a one-stage pipeline would. forward(input_ids, labels, seq_idx=None)
-> loss; seq_idx (batch, seqlen) document ids reach every block, as in the pipeline.
The head is called as the `lm_head` module (its weight is the embedding's when tied), so ZeRO-3
gathers the tied weight through the module that uses it. A tensor-parallel `MambaLM` (built with
`tp`) gives vocab-split logits and the vocab-parallel loss.
"""
from typing import Optional

import torch
from torch import nn

from megamamba.lm import MambaLM
from megamamba.pipelines.layers import LMLoss, block_step, embed, final_norm, pack, unpack
from megamamba.pipelines.module import non_reentrant_checkpoint


class PlainLM(nn.Module):
    def __init__(self, model: MambaLM, checkpoint_interval: int = 0):
        super().__init__()
        if checkpoint_interval < 0:
            raise ValueError(f"checkpoint interval {checkpoint_interval}: must be >= 0")
        self.config = model.config
        self.backbone = model.backbone
        self.lm_head = model.lm_head
        self.checkpoint_interval = checkpoint_interval
        self.loss_fn = LMLoss(self.config.vocab_size, model.tp, model.cp)

    def _layers(self) -> list:
        residual_in_fp32 = self.config.residual_in_fp32
        return [
            lambda x: embed(self.backbone.embedding, x, residual_in_fp32),
            *[lambda x, block=block: block_step(block, x) for block in self.backbone.layers],
            lambda x: final_norm(self.backbone.norm_f, unpack(x)[0]),
            self.lm_head,
        ]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                seq_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
        layers = self._layers()
        k = self.checkpoint_interval or len(layers)
        x = pack(input_ids, seq_idx)
        for start in range(0, len(layers), k):
            run = layers[start : start + k]
            if self.checkpoint_interval and self.training:
                x = non_reentrant_checkpoint(_run_layers, run, x)
            else:
                x = _run_layers(run, x)
        return self.loss_fn(x, labels)


def _run_layers(layers: list, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x
