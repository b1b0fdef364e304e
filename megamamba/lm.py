"""The Mamba language model on one device: embedding -> blocks -> final norm -> head.

State-dict keys are mamba_ssm's `MambaLMHeadModel`: `backbone.embedding.weight`,
`backbone.layers.{i}.norm.weight`, `backbone.layers.{i}.mixer.*`, `backbone.norm_f.weight`,
`lm_head.weight` (the embedding's tensor when tie_embeddings). The vocabulary is padded to
a multiple of `pad_vocab_size_multiple`; logits have the padded width, and the extra
columns are for the caller to drop (`logits[..., :config.vocab_size]`).

Initialisation is mamba_ssm's `_init_weights`: PyTorch's defaults for Linear and Conv1d,
the mixers' SSM init, then every Linear bias zeroed (except dt_proj.bias), the embedding
drawn from N(0, 0.02^2), and each mixer's out_proj re-drawn and scaled by
1/sqrt(n_layer) (GPT-2's rescale of the residual branches; one residual per layer, no MLP).
"""
import math
from typing import Optional

import torch
from torch import nn

from megamamba.block import Block, make_norm
from megamamba.config import MambaConfig

EMBEDDING_INIT_STD = 0.02


class MambaBackbone(nn.Module):
    """Token ids -> final-normed hidden states (batch, seqlen, d_model)."""

    def __init__(self, config: MambaConfig, device=None, dtype=None):
        super().__init__()
        self.embedding = nn.Embedding(config.padded_vocab_size, config.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(Block(config, device=device, dtype=dtype) for _ in range(config.n_layer))
        self.norm_f = make_norm(config, device=device, dtype=dtype)

    def _final_norm(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        residual = hidden_states + residual
        return self.norm_f(residual.to(dtype=self.norm_f.weight.dtype))

    def forward(self, input_ids: torch.Tensor, seq_idx: Optional[torch.Tensor] = None,
                inference_cache: Optional[list] = None) -> torch.Tensor:
        hidden_states, residual = self.embedding(input_ids), None
        for i, layer in enumerate(self.layers):
            state = None if inference_cache is None else inference_cache[i]
            hidden_states, residual = layer(hidden_states, residual, seq_idx=seq_idx, inference_state=state)
        return self._final_norm(hidden_states, residual)

    def step(self, input_ids: torch.Tensor, inference_cache: list) -> torch.Tensor:
        hidden_states, residual = self.embedding(input_ids), None
        for layer, state in zip(self.layers, inference_cache):
            hidden_states, residual = layer.step(hidden_states, residual, state)
        return self._final_norm(hidden_states, residual)


class MambaLM(nn.Module):
    """Mamba-1 / Mamba-2 language model: `MambaLM(config)(input_ids)` -> logits (batch, seqlen, padded vocab)."""

    def __init__(self, config: MambaConfig, device=None, dtype=None):
        super().__init__()
        config.validate()
        self.config = config
        self.backbone = MambaBackbone(config, device=device, dtype=dtype)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab_size, bias=False, device=device, dtype=dtype)
        self._init_weights()
        if config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    @torch.no_grad()
    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                if not getattr(module.bias, "_no_reinit", False):
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=EMBEDDING_INIT_STD)
        for layer in self.backbone.layers:
            out_proj = layer.mixer.out_proj.weight
            nn.init.kaiming_uniform_(out_proj, a=math.sqrt(5))
            out_proj /= math.sqrt(self.config.n_layer)

    def forward(self, input_ids: torch.Tensor, seq_idx: Optional[torch.Tensor] = None,
                inference_cache: Optional[list] = None) -> torch.Tensor:
        """input_ids (batch, seqlen) -> logits (batch, seqlen, padded_vocab_size).

        seq_idx (batch, seqlen) int32 document ids: the state of every layer resets where the id
        changes, so packed documents do not see each other. inference_cache (from
        allocate_inference_cache): filled with the states after the last position, so `step`
        continues the sequence (prefill); not combined with seq_idx.
        """
        if seq_idx is not None and seq_idx.shape != input_ids.shape:
            raise ValueError(f"seq_idx shape {tuple(seq_idx.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
        if seq_idx is not None and inference_cache is not None:
            raise ValueError("inference_cache with seq_idx: a prefill continues one sequence; pass packed documents without a cache")
        return self.lm_head(self.backbone(input_ids, seq_idx=seq_idx, inference_cache=inference_cache))

    def allocate_inference_cache(self, batch_size: int, dtype=None) -> list:
        """Zeroed recurrent state for `step`: one (conv_state, ssm_state) per layer."""
        return [layer.mixer.allocate_inference_cache(batch_size, dtype=dtype) for layer in self.backbone.layers]

    def step(self, input_ids: torch.Tensor, inference_cache: list) -> torch.Tensor:
        """One token per sequence: input_ids (batch,) -> logits (batch, padded_vocab_size); the cache advances in place."""
        return self.lm_head(self.backbone.step(input_ids, inference_cache))
