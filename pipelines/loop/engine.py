"""The trainer of a layout: DeepSpeed's engine behind the operations a job needs (`Trainer`).

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
once the ranks have agreed that the optimizer step was applied; so are the expert biases of
mixture-of-experts routers (aux-loss-free balancing), which a skipped step leaves alone. Under expert
parallelism (layout.ep > 1) the expert parameters go to optimizer groups of their own that DeepSpeed reduces,
and ZeRO partitions, over the expert-data-parallel group (`_initialize`).

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

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional, Union

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from megamamba.checkpoint import optimizer_groups, restore_optimizer_state, scheduler_state
from megamamba.config import MambaConfig
from megamamba.model.layers import draw_seed, initial_layer, layer_of
from megamamba.model.lm import MambaLM
from megamamba.model.moe_router import forget_router_loads, router_loads, update_expert_biases
from megamamba.optim import param_groups
from megamamba.parallel import TensorParallel, full_key
from megamamba.parallel.context.context_parallel import ContextParallel, sequence_window
from megamamba.parallel.expert.expert_parallel import ExpertParallel, holds_split_experts
from megamamba.parallel.groups import ParallelGroups
from megamamba.pipelines.config.layout import Layout
from megamamba.pipelines.deepspeed_internals import (
    engines_with_experts,
    expert_param_groups,
    full_numel,
    is_zero_optimizer,
    mark_expert_parameters,
    register_expert_groups,
    set_global_steps,
    set_scheduler_lrs,
    skipped_steps,
    zero_param_groups,
)
from megamamba.pipelines.loop import clipping
from megamamba.pipelines.loop.agreement import agree, to_device
from megamamba.pipelines.memory.host import reuse_freed_tensors, unmap_freed_tensors
from megamamba.pipelines.memory.optimizer_state import optimizer_state_bytes
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


def _initialize(
    module: torch.nn.Module, settings: OptimizerSettings, engine_config: dict, groups: ParallelGroups, mpu=None
) -> tuple:
    """(DeepSpeed's engine, the optimizer it steps, the client's AdamW) for `module` trained with fused AdamW (one
    kernel per step; it skips a non-finite step on the device, `found_inf`). Expert parameters split over an
    expert-parallel group carry DeepSpeed's MoE marks and groups of their own, and the engine is told the model
    holds MoE layers, so that their gradients are averaged over the expert-data-parallel group only, where ZeRO
    partitions them (`pipelines.deepspeed_internals`)."""
    groups_of_params = param_groups(module, settings.weight_decay)
    experts = [p for p in module.parameters() if holds_split_experts(p)]
    with_experts: contextlib.AbstractContextManager = contextlib.nullcontext()
    if experts:
        ep_size, ep_group, edp_group = groups.expert_parallel_size, groups.expert_group, groups.expert_data_group
        assert ep_group is not None and edp_group is not None, "split experts come with an expert-parallel group"
        register_expert_groups(ep_size, ep_group, edp_group)
        mark_expert_parameters(experts, ep_size)
        groups_of_params = expert_param_groups(groups_of_params, holds_split_experts, ep_size)
        with_experts = engines_with_experts()
    optimizer = torch.optim.AdamW(
        groups_of_params, lr=settings.schedule.peak, betas=settings.betas, eps=settings.eps, fused=True
    )
    with with_experts:
        engine, engine_optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, mpu=mpu, config=engine_config
        )
    return engine, engine_optimizer, optimizer


class Trainer(ABC):
    """The operations a job asks of its trainer, over DeepSpeed's engine, its optimizer and the LR scheduler.

    Each engine's subclass builds these (private) objects and sets the ranks; code outside this module uses
    the methods, never the objects.
    """

    _engine: deepspeed.DeepSpeedEngine
    _optimizer: Any  # the engine's: the client's fused AdamW, or DeepSpeed's ZeRO optimizer over it
    _lr_scheduler: torch.optim.lr_scheduler.LambdaLR
    _module: torch.nn.Module
    tp: Optional[TensorParallel]
    cp: Optional[ContextParallel]

    @abstractmethod
    def train_step(self, micro_batches: list) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; the loss as a device tensor."""

    @abstractmethod
    def mamba_name(self, name: str) -> str:
        """The mamba_ssm name of a parameter's full name (`megamamba.parallel.full_key`)."""

    @abstractmethod
    def _eval_loss(self, micro_batches: list) -> torch.Tensor:
        """This rank's share of a global batch's validation loss (device)."""

    def _set_place(self, groups: ParallelGroups, tp: Optional[TensorParallel], cp: Optional[ContextParallel]) -> None:
        """This rank's place on each axis of the grid, and its TP and CP groups (None at size 1)."""
        self.dp_rank, self.context_rank = groups.data_rank, groups.context_rank
        self.expert_data_rank = groups.expert_data_rank
        self.tensor_rank, self.pipe_rank = groups.tensor_rank, groups.pipe_rank
        self.tp, self.cp = tp, cp
        self._stage_replicas = groups.data_group if groups.data_axis_size > 1 else None
        self._router_loads: list = []

    # The step and its outcome.

    def finish_step(self, applied: bool) -> None:
        """After an optimizer step the ranks agree was applied, advance the LR schedule and move the expert biases
        of aux-loss-free balancing by the tokens every expert received over the data x context-parallel ranks of
        this stage (`megamamba.model.moe_router.update_expert_biases`: one all-reduce); after a skipped step,
        forget those counts. What the routers counted stays readable (`router_states`) until the next step ends."""
        self._router_loads = router_loads(self._module)
        if applied:
            self._lr_scheduler.step()
            update_expert_biases(self._module, self._stage_replicas)
        else:
            forget_router_loads(self._module)

    def eval_loss(self, micro_batches: list) -> float:
        """The validation loss of one global batch (collective; one host synchronization)."""
        return agree([self._eval_loss(micro_batches) / dist.get_world_size()])[0]

    def window(self, seq_length: int) -> Optional[tuple[int, int]]:
        """The sequence positions [lo, hi) this rank's micro-batches hold: its slice under CP, else all (None)."""
        return None if self.cp is None else sequence_window(seq_length, self.cp)

    def learning_rate(self) -> float:
        """The learning rate of the next optimizer step (a skipped step does not advance it)."""
        return float(self._lr_scheduler.get_last_lr()[0])

    def grad_norm(self) -> Optional[float]:
        """The global gradient norm of the last step (None before the first)."""
        norm = self._engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def skipped_steps(self) -> int:
        """The steps DeepSpeed's ZeRO optimizer skipped for a non-finite gradient norm, so far."""
        return skipped_steps(self._engine)

    def optimizer_without_zero(self) -> Optional[torch.optim.Optimizer]:
        """The torch optimizer the engine steps itself, without ZeRO (which skips non-finite steps on its own)."""
        if isinstance(self._optimizer, torch.optim.Optimizer) and not self._engine.zero_optimization():
            return self._optimizer
        return None

    # What the run records.

    def router_states(self) -> list:
        """(mamba_ssm name of its weight, `RouterLoad` of the last step or None, expert bias or None) of every
        mixture-of-experts router of this rank's stage."""
        routers = dict(self._module.named_modules())
        return [
            (self.mamba_name(f"{name}.weight"), load, routers[name].e_score_correction_bias)
            for name, load in self._router_loads
        ]

    def stage_parameter_count(self) -> int:
        """Elements of this rank's parameters, full sizes (a ZeRO-3 partition counts as its whole parameter)."""
        return sum(full_numel(p) for p in self._module.parameters())

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (`pipelines.memory.optimizer_state`)."""
        return optimizer_state_bytes(self._optimizer, self._module)

    def scheduler_epoch(self) -> int:
        """The LR scheduler's position: the optimizer steps it has counted."""
        return self._lr_scheduler.last_epoch

    # What checkpoints and --init-from read and set.

    def named_parameters(self) -> list:
        """(module name, mamba_ssm name, parameter) of every parameter of this rank's stage (a tied one once)."""
        return [(n, self.mamba_name(full_key(n, p)), p) for n, p in self._module.named_parameters()]

    def engine_optimizer(self):
        """The optimizer the engine steps: torch's AdamW, DeepSpeed's ZeRO optimizer over it, or another wrapper."""
        return self._optimizer

    def zero_stage(self) -> int:
        """DeepSpeed's ZeRO stage (0: none)."""
        return self._engine.zero_optimization_stage()

    def optimizer_groups(self) -> list:
        """Each optimizer group's hyperparameters (JSON), "params" its members' mamba_ssm names."""
        zero = self._optimizer if is_zero_optimizer(self._optimizer) else None
        if zero is None:
            groups = optimizer_groups(self._optimizer, self._module)
        else:
            groups = optimizer_groups(zero.optimizer, self._module, members=zero_param_groups(zero))
        return [{**g, "params": [self.mamba_name(n) for n in g["params"]]} for g in groups]

    def restore_optimizer_state(self, state: dict, saved_groups: list) -> None:
        """torch AdamW's state, `state[module name] = {key: tensor}`, from a checkpoint whose groups
        (`saved_groups`, mamba_ssm names) must hold the same parameters (`megamamba.checkpoint`)."""
        module_names = {mamba: full_key(n, p) for n, mamba, p in self.named_parameters()}
        groups = [{**g, "params": [module_names[m] for m in g["params"]]} for g in saved_groups]
        restore_optimizer_state(self._optimizer, self._module, state, groups)

    def scheduler_state(self) -> dict:
        """The LR scheduler's state as JSON."""
        return scheduler_state(self._lr_scheduler)

    def restore_scheduler(self, state: Optional[dict], step: int) -> None:
        """The saved scheduler position (epoch) under the run's schedule: base LRs stay the run's peak, so the
        group LRs are the run's schedule at the saved epoch (the saved ones, unless the plan was overridden).
        A checkpoint without scheduler state (saved by the single-process API without one): epoch `step`."""
        scheduler = self._lr_scheduler
        if state is None:
            scheduler.last_epoch = step
        else:
            scheduler.load_state_dict(dict(state))
        scheduler.base_lrs = [group["initial_lr"] for group in scheduler.optimizer.param_groups]
        lrs = [base * rule(scheduler.last_epoch) for rule, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr
        set_scheduler_lrs(scheduler, lrs)

    def global_step(self) -> int:
        """The engine's optimizer-step counter: the steps taken so far, applied or skipped (`set_global_step`)."""
        return self._engine.global_steps

    def set_global_step(self, step: int) -> None:
        """The engine's optimizer-step counter, set when resuming."""
        set_global_steps(self._engine, step)

    # The model.

    def compile(self, backend: str) -> None:
        """Compile the model with torch.compile's `backend` (DeepSpeed's `engine.compile`)."""
        self._engine.compile(backend=backend)


class PipelineTrainer(Trainer):
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
        ep: Optional[ExpertParallel],
    ):
        module = build_pipeline_module(
            config, groups.topology, partition_method, checkpoint_interval, tp, cp, seq_length=seq_length, ep=ep
        )
        load_mamba_state_dict(module, InitialState(config, seed), config, tp)
        self._engine, self._optimizer, optimizer = _initialize(module, settings, engine_config, groups)
        self._lr_scheduler = settings.schedule.scheduler(optimizer)
        self._module, self.config = module, config
        self._set_place(groups, tp, cp)
        if not self._engine.zero_optimization():
            clipping.install(
                self._engine,
                self._engine.grid.get_slice_parallel_rank(),
                self._engine.grid.get_model_parallel_group(),
                groups.expert_group,
            )

    def mamba_name(self, name: str) -> str:
        """The mamba_ssm name of a stage parameter's full name (`megamamba.parallel.full_key`)."""
        return to_mamba(name, self.config)

    def train_step(self, micro_batches: list) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; the global batch's mean loss (device, every rank)."""
        return self._engine.train_batch(_pipeline_batches(micro_batches))

    def _eval_loss(self, micro_batches: list) -> torch.Tensor:
        return self._engine.eval_batch(_pipeline_batches(micro_batches), num_micro_batches=len(micro_batches))


def _pipeline_batches(micro_batches: list):
    """(inputs, labels, seq_idx) -> DeepSpeed's (first-stage input, last-stage labels): ids or (ids, seq_idx),
    already on the device (the engine's own copies would wait for it)."""
    return iter(
        [
            (to_device(inputs) if seq_idx is None else (to_device(inputs), to_device(seq_idx)), to_device(labels))
            for inputs, labels, seq_idx in micro_batches
        ]
    )


class PlainTrainer(Trainer):
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
        ep: Optional[ExpertParallel],
    ):
        torch.manual_seed(seed)
        module = MambaLM(config, tp=tp, cp=cp, checkpoint_interval=checkpoint_interval, ep=ep)
        module = module.to(get_accelerator().current_device_name())
        mpu = groups.mpu() if tp is not None else None
        self._engine, self._optimizer, optimizer = _initialize(module, settings, engine_config, groups, mpu)
        self._lr_scheduler = settings.schedule.scheduler(optimizer)
        self._module = module
        self._set_place(groups, tp, cp)
        if not self._engine.zero_optimization():
            clipping.install(
                self._engine, groups.tensor_rank, groups.tensor_group if tp is not None else None, groups.expert_group
            )

    def mamba_name(self, name: str) -> str:
        """The mamba_ssm name of a parameter's full name: the plain module's names are mamba_ssm's."""
        return name

    def loss(self, inputs, labels, seq_idx) -> torch.Tensor:
        """The forward pass of one micro-batch: its loss, the graph kept for `backward`."""
        return self._engine(to_device(inputs), to_device(labels), None if seq_idx is None else to_device(seq_idx))

    def backward(self, loss: torch.Tensor) -> None:
        """The backward pass of a micro-batch's `loss` (gradients accumulate until the engine's step)."""
        self._engine.backward(loss)

    def train_step(self, micro_batches: list) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; their mean loss (device; averaged over data
        parallel ranks by the caller's agreement)."""
        losses = []
        for batch in micro_batches:
            loss = self.loss(*batch)
            self.backward(loss)
            self._engine.step()
            losses.append(loss.detach().float())
        return torch.stack(losses).mean()

    @torch.no_grad()
    def _eval_loss(self, micro_batches: list) -> torch.Tensor:
        self._engine.eval()
        losses = [self.loss(*batch).float() for batch in micro_batches]
        self._engine.train()
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
    compile_backend: Optional[str] = None,
):
    """The trainer of this rank (torch.distributed initialised, world size = layout.world_size) for sequences of
    `seq_length` tokens (the pipeline's "cost" partition weighs the layers at that length); its model compiled by
    torch.compile with `compile_backend` when one is given (DeepSpeed's `engine.compile`: the whole model at
    pipeline size 1, each layer of a pipeline stage)."""
    unmap_freed_tensors()
    groups = ParallelGroups(layout.tp, layout.pp, layout.dp, layout.cp, layout.ep)
    tp = groups.tensor_parallel(sequence_parallel) if layout.tp > 1 else None
    cp = groups.context_parallel() if layout.cp > 1 else None
    ep = groups.expert_parallel() if layout.ep > 1 else None
    if layout.pp > 1:
        trainer = PipelineTrainer(
            groups,
            tp,
            cp,
            config,
            engine_config,
            settings,
            seed,
            partition_method,
            checkpoint_interval,
            seq_length,
            ep,
        )
    else:
        trainer = PlainTrainer(groups, tp, cp, config, engine_config, settings, seed, checkpoint_interval, ep)
    reuse_freed_tensors()
    if compile_backend is not None:
        trainer.compile(compile_backend)
    return trainer
