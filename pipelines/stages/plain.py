"""The pp = 1 engine's module: `MambaLM`'s own layer list, run in order, with the loss.

Runs of `checkpoint_interval` consecutive layers are recomputed in the backward (non-reentrant
checkpoint), as DeepSpeed's pipeline does within a stage. The module holds the model's `backbone`
and `lm_head`, so its parameter names are mamba_ssm's, and calls the head as the `lm_head` module
(its weight the embedding's when tied), so ZeRO-3 gathers the tied weight through the module that uses it.
"""

from typing import Optional

import torch
from torch import nn

from megamamba.model.lm import MambaLM, layer_list
from megamamba.model.stream import pack
from megamamba.pipelines.stages.loss import LMLoss
from megamamba.pipelines.stages.pipeline_module import non_reentrant_checkpoint


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

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, seq_idx: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        layers = layer_list(self)
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
