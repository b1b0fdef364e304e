"""The model's layer list (`megamamba.model.layers`) as a DeepSpeed PipelineModule, one spec per layer.

With tie_embeddings the embedding and the head are one tied layer spec ("embed"): the first and
the last stage each hold the weight and DeepSpeed all-reduces its gradient between them. The
loss (`megamamba.model.loss.training_loss`) runs on the last stage.

A stage runs the model's own loop over its layers (`StreamPipeline`). The layers pass the model's `Stream`; only
between stages (and from the data) does DeepSpeed hand it over, as the tuple (hidden, seq_idx), or the tensor
alone without documents. With mixture-of-experts blocks (E) the router losses travel last in that tuple, a float
scalar (zero before the first E), and the last stage hands (logits, aux_loss) to the loss (`pipeline_loss`).

Layers are built without their default initialisation (`pipelines.stages.uninitialised`): the caller
copies the stage's weights in, the initial ones or a checkpoint's.

The stages: `pipelines.stages.partition` (by cost or a pattern's | marks; else DeepSpeed's methods).

Activation checkpointing every k layers: the loop cuts each stage's layers into runs of k and recomputes each
run in the backward (DeepSpeed's own interval stays 0).
"""

import functools
from typing import Optional

import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import ProcessTopology

from megamamba.config import MambaConfig
from megamamba.model.layer_types.head import tied_head
from megamamba.model.layers import layer_arguments, layer_class, layer_count
from megamamba.model.lm import run_layers
from megamamba.model.loss import training_loss
from megamamba.model.stream import Stream
from megamamba.parallel import TensorParallel, split
from megamamba.parallel.context.context_parallel import ContextParallel
from megamamba.parallel.expert.expert_parallel import ExpertParallel
from megamamba.pipelines.deepspeed_internals import pipeline_module_with_stages, stage_layers
from megamamba.pipelines.stages.names import TIED_KEY
from megamamba.pipelines.stages.partition import DEFAULT_PARTITION, check_partition_method, own_bounds
from megamamba.pipelines.stages.uninitialised import UninitialisedLayerSpec, UninitialisedTiedLayerSpec


class StreamPipeline(PipelineModule):
    """DeepSpeed's PipelineModule whose stage runs the model's own loop (`megamamba.model.lm.run_layers`) over its
    slice of the layer list, recomputing runs of `checkpoint_interval` layers in training as `MambaLM` does. A
    stage takes what DeepSpeed hands it (the data's (token ids, seq_idx), or the previous stage's (hidden,
    seq_idx); a tensor alone without documents) as a Stream, and gives DeepSpeed its last layer's Stream as that
    tuple (the head's logits as they are). With `carries_aux_loss` (the model has E blocks) the router losses
    so far follow last in the tuple between stages, and the last stage returns (logits, aux_loss)."""

    def __init__(self, *, checkpoint_interval: int, carries_aux_loss: bool, **settings):
        super().__init__(**settings)
        self.checkpoint_interval = checkpoint_interval
        self.carries_aux_loss = carries_aux_loss

    def forward(self, forward_input):
        stream = self._stream_of(forward_input)
        k = self.checkpoint_interval if self.training else 0
        layers = stage_layers(self)
        if self.stage_id != self.num_stages - 1:
            return self._handed_on(run_layers(layers, stream, k))
        *blocks, head = layers
        out = run_layers(blocks, stream, k)
        logits = head(out)
        return (logits, self._aux_loss_of(out)) if self.carries_aux_loss else logits

    def _stream_of(self, forward_input) -> Stream:
        """What DeepSpeed hands the stage as a Stream: (ids or hidden, seq_idx?, aux_loss?), or a tensor alone."""
        parts = forward_input if isinstance(forward_input, tuple) else (forward_input,)
        if not (self.carries_aux_loss and self.stage_id > 0):
            return Stream.of(*parts)
        hidden, *documents, aux_loss = parts
        return Stream(hidden, documents[0] if documents else None, aux_loss)

    def _handed_on(self, out: Stream):
        """The stream as DeepSpeed sends it to the next stage: (hidden, seq_idx?, aux_loss?), or hidden alone."""
        parts = (out.hidden,) if out.seq_idx is None else (out.hidden, out.seq_idx)
        if self.carries_aux_loss:
            parts = (*parts, self._aux_loss_of(out))
        return parts if len(parts) > 1 else parts[0]

    @staticmethod
    def _aux_loss_of(out: Stream) -> torch.Tensor:
        """The stream's router losses; before the first E block a float zero, which (sent on, as every float
        DeepSpeed sends) takes a gradient in the backward."""
        if out.aux_loss is not None:
            return out.aux_loss
        dtype = torch.promote_types(out.hidden.dtype, torch.float32)
        return torch.zeros((), dtype=dtype, device=out.hidden.device, requires_grad=True)


def pipeline_loss(outputs, labels: torch.Tensor, **settings) -> torch.Tensor:
    """The last stage's training loss (`training_loss` with `settings`) of its logits, or of (logits, aux_loss)."""
    if isinstance(outputs, tuple):
        logits, aux_loss = outputs
        return training_loss(logits, labels, aux_loss=aux_loss, **settings)
    return training_loss(outputs, labels, **settings)


def layer_specs(
    config: MambaConfig,
    tp: Optional[TensorParallel] = None,
    cp: Optional[ContextParallel] = None,
    ep: Optional[ExpertParallel] = None,
) -> list:
    """The layer list as DeepSpeed layer specs (split across `tp` when given; blocks on a slice of every
    sequence under `cp`; the experts split over `ep`), built with uninitialised parameters."""
    tp = split(tp)
    specs = [
        UninitialisedLayerSpec(layer_class(config, i, tp), config, **layer_arguments(config, i, tp, cp, ep))
        for i in range(layer_count(config))
    ]
    if config.tie_embeddings:
        embedding = layer_class(config, 0, tp)
        specs[0] = UninitialisedTiedLayerSpec(TIED_KEY, embedding, config, tp=tp)
        specs[-1] = UninitialisedTiedLayerSpec(TIED_KEY, embedding, config, tp=tp, forward_fn=tied_head)
    return specs


def build_pipeline_module(
    config: MambaConfig,
    topology: ProcessTopology,
    partition_method: str = DEFAULT_PARTITION,
    checkpoint_interval: int = 0,
    tp: Optional[TensorParallel] = None,
    cp: Optional[ContextParallel] = None,
    *,
    seq_length: int,
    ep: Optional[ExpertParallel] = None,
) -> PipelineModule:
    """This rank's stage of the model (needs torch.distributed initialised; `tp` and `cp` from the same
    topology) for sequences of `seq_length` tokens (the whole sequence under `cp`), its parameters
    uninitialised: load them (`pipelines.stages.names.load_mamba_state_dict`) before use."""
    check_partition_method(partition_method)
    settings = dict(
        layers=layer_specs(config, tp, cp, ep),
        topology=topology,
        loss_fn=functools.partial(pipeline_loss, vocab_size=config.vocab_size, tp=tp, cp=cp),
        checkpoint_interval=checkpoint_interval,
        carries_aux_loss=config.has_moe_layers,
    )
    bounds = own_bounds(config, topology.get_dim("pipe"), partition_method, seq_length)
    if bounds is None:
        return StreamPipeline(partition_method=partition_method, **settings)
    return pipeline_module_with_stages(StreamPipeline, bounds, **settings)
