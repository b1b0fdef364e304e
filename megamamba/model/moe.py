"""The mixer of a mixture-of-experts block (pattern symbol E): a router, routed experts and an optional shared
expert, as transformers' NemotronH MoE (`mixer.gate`, `mixer.experts`, `mixer.shared_experts`).

Each token goes to its top_k experts (`megamamba.model.moe_router`); their copies are sorted by expert
(`megamamba.model.moe_dispatch`), run through the grouped experts (`megamamba.model.moe_experts`) and summed back
with the routing weights; the shared expert, an MLP every token passes, is added. Under expert parallelism the
sorted rows travel to the ranks holding their experts and back (`megamamba.parallel.expert.dispatch`). `routed`
also returns the router's load-balancing and z losses, which the block hands on with the stream to the training
loss.
"""

from typing import Optional

import torch
from torch import nn

from megamamba.config import MoEOptions
from megamamba.model.mlp import MLP
from megamamba.model.moe_dispatch import capacity_of, combine, permute, sort_by_expert
from megamamba.model.moe_experts import GroupedExperts
from megamamba.model.moe_router import Router
from megamamba.parallel import split
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.expert.dispatch import from_expert_ranks, to_expert_ranks
from megamamba.parallel.expert.expert_parallel import ExpertParallel

MLP_ACTIVATION = {"relu2": "squared_relu", "gated_silu": "gated_silu"}  # the shared expert's, as the MLP names it


class MoE(nn.Module):
    """(batch, seqlen, d_model) -> (batch, seqlen, d_model), token by token."""

    def __init__(
        self,
        d_model: int,
        options: MoEOptions,
        device=None,
        dtype=None,
        ep: Optional[ExpertParallel] = None,
        cp: Optional[ContextParallel] = None,
    ):
        super().__init__()
        self.options = options
        self.ep = split(ep)
        self.gate = Router(d_model, options, device=device, dtype=dtype, cp=cp)
        self.experts = GroupedExperts(
            options.num_experts,
            d_model,
            options.ffn_hidden_size,
            options.activation,
            device=device,
            dtype=dtype,
            here=None if self.ep is None else self.ep.experts_here(options.num_experts),
        )
        self.shared_experts = None
        if options.shared_expert_ffn_hidden_size:
            self.shared_experts = MLP(
                d_model,
                options.shared_expert_ffn_hidden_size,
                MLP_ACTIVATION[options.activation],
                device=device,
                dtype=dtype,
            )

    def routed(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(the output in float32 or wider, the router's losses or None)."""
        batch, seqlen, d_model = hidden.shape
        routing = self.gate(hidden)
        o = self.options
        capacity = (
            None
            if o.capacity_factor is None
            else capacity_of(batch * seqlen, o.top_k, o.num_experts, o.capacity_factor)
        )
        dispatch = sort_by_expert(routing.experts, routing.tokens_per_expert, routing.weights, capacity)
        rows = permute(hidden.reshape(-1, d_model), dispatch)
        if self.ep is None:
            rows = self.experts(rows, dispatch.tokens_per_expert)
        else:
            here, tokens_per_expert, route = to_expert_ranks(rows, dispatch.tokens_per_expert, self.ep)
            rows = from_expert_ranks(self.experts(here, tokens_per_expert), route, self.ep)
        out = combine(rows, dispatch, routing.weights).view(batch, seqlen, d_model)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out, routing.aux_loss

    def forward(
        self,
        hidden_states: torch.Tensor,
        seq_idx: Optional[torch.Tensor] = None,
        inference_state: Optional[tuple] = None,
    ) -> torch.Tensor:
        """Token by token: `seq_idx` and `inference_state` are taken as every mixer takes them, and unused."""
        return self.routed(hidden_states)[0]

    def allocate_inference_cache(self, batch_size: int, dtype=None) -> None:
        """No state: experts see one token at a time."""
        return None

    def step(self, hidden_states: torch.Tensor, inference_state: None) -> torch.Tensor:
        """One token per sequence, (batch, d_model)."""
        return self(hidden_states.unsqueeze(1)).squeeze(1)
