"""The DeepSpeed engine for a layout, behind one train-step / eval-step interface.

pp > 1: DeepSpeed's PipelineEngine over `build_pipeline_module` (ZeRO 0 or 1).
pp = 1: the plain DeepSpeedEngine over `MambaLM` itself, whose forward with labels is the training loss
(any ZeRO stage), with our `mpu` under TP.
Process groups come from `megamamba.parallel.groups.ParallelGroups`, laid out by the same
DeepSpeed topology the pipeline engine builds its grid from, so both agree on every rank.

Initial weights do not depend on the layout: they are those of `MambaLM(config)` built under
`torch.manual_seed(seed)`, whose layers draw from their own seeded streams. The plain engine
builds its `MambaLM` (its TP shards) that way; a pipeline stage copies its parameters out of
`InitialState`, which draws one full layer at a time, so no rank ever holds more than its own
stage and one full layer. The stage's layers are built without their own initialisation
(`pipelines.stages.uninitialised`), which these copies would overwrite.

Without ZeRO, gradient clipping uses `pipelines.loop.clipping` (DeepSpeed's stage-0 norm
miscounts pipeline stages and tied weights). The optimizer is torch's fused AdamW over
`megamamba.optim.param_groups`, handed to DeepSpeed as a client optimizer: no JIT-compiled
FusedAdam. The learning rate follows an `LRSchedule`, stepped by the trainer (`finish_step`)
once the ranks have agreed that the optimizer step was applied.

A step makes no host synchronization: `train_step` returns the loss as a device tensor, batches
travel to the device from pinned memory, and the caller agrees on the loss and the step's flags
in one reduction (`megamamba.pipelines.loop.faults.agree_step`).

Micro-batches are (inputs, labels, seq_idx) as `megamamba.data.batches` makes them: seq_idx
(document ids, or None) goes to the model beside the ids, so every block resets its state at
document boundaries; the pipeline engine receives it as the first stage's input pair.

Context parallelism (layout.cp = C > 1): the trainer's micro-batches are its slice (`window`) of
the sequences of its data-parallel replica's micro-batches (`dp_rank` counts replicas, not CP
ranks), read alone by the data path; the loss is the whole sequences' mean, its gradient scaled
for DeepSpeed's average over dp x C ranks (`megamamba.model.loss.training_loss`).
"""

from dataclasses import dataclass
from typing import Optional, Union

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megamamba.config import MambaConfig
from megamamba.model.layers import draw_seed, initial_layer, layer_of
from megamamba.model.lm import MambaLM
from megamamba.optim import param_groups
from megamamba.parallel import TensorParallel
from megamamba.parallel.context.context_parallel import ContextParallel, sequence_window
from megamamba.parallel.groups import ParallelGroups
from megamamba.pipelines.config.layout import Layout
from megamamba.pipelines.loop import clipping
from megamamba.pipelines.loop.agreement import agree, to_device
from megamamba.pipelines.memory.host import reuse_freed_tensors, unmap_freed_tensors
from megamamba.pipelines.stages.names import load_mamba_state_dict, to_mamba
from megamamba.pipelines.stages.pipeline_module import build_pipeline_module
from megamamba.schedule.lr_schedule import DeepSpeedSchedule, LRSchedule


@dataclass(frozen=True)
class OptimizerSettings:
    schedule: Union[LRSchedule, DeepSpeedSchedule]
    weight_decay: float
    betas: tuple
    eps: float = 1e-8


class InitialState:
    """`MambaLM(config)`'s initial full tensors built under `torch.manual_seed(seed)`, by mamba_ssm name,
    drawn one layer at a time when first asked for (ask in model order: one layer is kept)."""

    def __init__(self, config: MambaConfig, seed: int):
        torch.manual_seed(seed)
        self.config, self.seed = config, draw_seed()
        self._layer, self._tensors = None, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        layer = layer_of(name, self.config)
        if layer != self._layer:
            self._layer, self._tensors = None, {}  # the previous layer goes before the next is drawn
            self._tensors, self._layer = initial_layer(self.config, layer, self.seed), layer
        return self._tensors[name]

    def __contains__(self, name: str) -> bool:
        try:
            layer_of(name, self.config)
        except KeyError:
            return False
        return True


def _optimizer(module: torch.nn.Module, settings: OptimizerSettings) -> torch.optim.AdamW:
    """Fused AdamW: one kernel per step, and it skips a non-finite step on the device (`found_inf`)."""
    return torch.optim.AdamW(
        param_groups(module, settings.weight_decay),
        lr=settings.schedule.peak,
        betas=settings.betas,
        eps=settings.eps,
        fused=True,
    )


class _Trainer:
    """What both trainers share: the LR schedule they step and the evaluation loss they agree on."""

    def finish_step(self, applied: bool) -> None:
        """Advance the LR schedule after an optimizer step the ranks agree was applied."""
        if applied:
            self.lr_scheduler.step()

    def eval_loss(self, micro_batches: list) -> float:
        """The validation loss of one global batch (collective; one host synchronization)."""
        return agree([self._eval_loss(micro_batches) / dist.get_world_size()])[0]

    def window(self, seq_length: int) -> Optional[tuple[int, int]]:
        """The sequence positions [lo, hi) this rank's micro-batches hold: its slice under CP, else all (None)."""
        return None if self.cp is None else sequence_window(seq_length, self.cp)


class PipelineTrainer(_Trainer):
    """Layouts with pp > 1."""

    def __init__(
        self,
        groups: ParallelGroups,
        tp: Optional[TensorParallel],
        cp: Optional[ContextParallel],
        config: MambaConfig,
        engine_config: dict,
        settings: OptimizerSettings,
        seed: int,
        partition_method: str,
        checkpoint_interval: int,
        seq_length: int,
    ):
        module = build_pipeline_module(
            config, groups.topology, partition_method, checkpoint_interval, tp, cp, seq_length=seq_length
        )
        load_mamba_state_dict(module, InitialState(config, seed), config, tp)
        optimizer = _optimizer(module, settings)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, config=engine_config
        )
        self.lr_scheduler = settings.schedule.scheduler(optimizer)
        self.dp_rank = groups.data_rank
        self.module, self.config = module, config
        self.groups, self.tp, self.cp = groups, tp, cp
        if not self.engine.zero_optimization():
            clipping.install(
                self.engine, self.engine.grid.get_slice_parallel_rank(), self.engine.grid.get_model_parallel_group()
            )

    def mamba_name(self, name: str) -> str:
        """The mamba_ssm name of a stage parameter's full name (`megamamba.parallel.full_key`)."""
        return to_mamba(name, self.config)

    def train_step(self, micro_batches: list) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; the global batch's mean loss (device, every rank)."""
        return self.engine.train_batch(_pipeline_batches(micro_batches))

    def _eval_loss(self, micro_batches: list) -> torch.Tensor:
        return self.engine.eval_batch(_pipeline_batches(micro_batches), num_micro_batches=len(micro_batches))


def _pipeline_batches(micro_batches: list):
    """(inputs, labels, seq_idx) -> DeepSpeed's (first-stage input, last-stage labels): ids or (ids, seq_idx),
    already on the device (the engine's own copies would wait for it)."""
    return iter(
        [
            (to_device(inputs) if seq_idx is None else (to_device(inputs), to_device(seq_idx)), to_device(labels))
            for inputs, labels, seq_idx in micro_batches
        ]
    )


class PlainTrainer(_Trainer):
    """Layouts with pp = 1."""

    def __init__(
        self,
        groups: ParallelGroups,
        tp: Optional[TensorParallel],
        cp: Optional[ContextParallel],
        config: MambaConfig,
        engine_config: dict,
        settings: OptimizerSettings,
        seed: int,
        checkpoint_interval: int,
    ):
        torch.manual_seed(seed)
        module = MambaLM(config, tp=tp, cp=cp, checkpoint_interval=checkpoint_interval)
        module = module.to(get_accelerator().current_device_name())
        optimizer = _optimizer(module, settings)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, mpu=groups.mpu() if tp is not None else None, config=engine_config
        )
        self.lr_scheduler = settings.schedule.scheduler(optimizer)
        self.groups, self.tp, self.cp = groups, tp, cp
        self.dp_rank = groups.data_rank
        self.module = module
        if not self.engine.zero_optimization():
            clipping.install(self.engine, groups.tensor_rank, groups.tensor_group if tp is not None else None)

    def mamba_name(self, name: str) -> str:
        """The mamba_ssm name of a parameter's full name: the plain module's names are mamba_ssm's."""
        return name

    def _forward(self, inputs, labels, seq_idx) -> torch.Tensor:
        return self.engine(to_device(inputs), to_device(labels), None if seq_idx is None else to_device(seq_idx))

    def train_step(self, micro_batches: list) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; their mean loss (device; averaged over data
        parallel ranks by the caller's agreement)."""
        losses = []
        for batch in micro_batches:
            loss = self._forward(*batch)
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.detach().float())
        return torch.stack(losses).mean()

    @torch.no_grad()
    def _eval_loss(self, micro_batches: list) -> torch.Tensor:
        self.engine.eval()
        losses = [self._forward(*batch).float() for batch in micro_batches]
        self.engine.train()
        return torch.stack(losses).mean()


def build_trainer(
    layout: Layout,
    config: MambaConfig,
    engine_config: dict,
    settings: OptimizerSettings,
    seed: int,
    partition_method: str,
    checkpoint_interval: int,
    sequence_parallel: bool = False,
    *,
    seq_length: int,
):
    """The trainer of this rank (torch.distributed initialised, world size = layout.world_size) for sequences of
    `seq_length` tokens (the pipeline's "cost" partition weighs the layers at that length)."""
    unmap_freed_tensors()
    groups = ParallelGroups(layout.tp, layout.pp, layout.dp, layout.cp)
    tp = groups.tensor_parallel(sequence_parallel) if layout.tp > 1 else None
    cp = groups.context_parallel() if layout.cp > 1 else None
    if layout.pp > 1:
        trainer = PipelineTrainer(
            groups, tp, cp, config, engine_config, settings, seed, partition_method, checkpoint_interval, seq_length
        )
    else:
        trainer = PlainTrainer(groups, tp, cp, config, engine_config, settings, seed, checkpoint_interval)
    reuse_freed_tensors()
    return trainer
