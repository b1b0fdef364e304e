"""The DeepSpeed engine for a layout, behind one train-step / eval-step interface.

pp > 1: DeepSpeed's PipelineEngine over `build_pipeline_module` (ZeRO 0 or 1).
pp = 1: the plain DeepSpeedEngine over `PlainLM` (any ZeRO stage).

Initial weights do not depend on the layout: every rank builds the full single-device
`MambaLM(config)` on the CPU under `torch.manual_seed(seed)` and copies its own parameters out
of it by mamba_ssm name, exactly as it would load a checkpoint. (This costs one float32 copy of
the model in host memory per rank while starting.)

Without ZeRO, gradient clipping uses `pipelines.clipping` (DeepSpeed's stage-0 norm miscounts
pipeline stages and tied weights). The optimizer is torch's AdamW over `megamamba.optim.param_groups` (fused on CUDA), handed to
DeepSpeed as a client optimizer: no JIT-compiled FusedAdam. The learning rate follows an
`LRSchedule`, stepped by the engine after each optimizer step.
"""
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megamamba.config import MambaConfig
from megamamba.lm import MambaLM
from megamamba.lr_schedule import LRSchedule
from megamamba.optim import param_groups
from megamamba.pipelines import clipping
from megamamba.pipelines.layout import Layout
from megamamba.pipelines.module import build_pipeline_module
from megamamba.pipelines.names import load_mamba_state_dict
from megamamba.pipelines.plain import PlainLM


@dataclass(frozen=True)
class OptimizerSettings:
    schedule: LRSchedule
    weight_decay: float
    betas: tuple


def initial_state(config: MambaConfig, seed: int) -> dict:
    """The full model's initial parameters under mamba_ssm's names (same on every rank and layout)."""
    torch.manual_seed(seed)
    return MambaLM(config).state_dict()


def _optimizer(module: torch.nn.Module, settings: OptimizerSettings) -> torch.optim.AdamW:
    fused = get_accelerator().device_name() == "cuda"
    return torch.optim.AdamW(param_groups(module, settings.weight_decay), lr=settings.schedule.peak,
                             betas=settings.betas, fused=fused)


class PipelineTrainer:
    """Layouts with pp > 1."""

    def __init__(self, layout: Layout, config: MambaConfig, engine_config: dict, settings: OptimizerSettings,
                 seed: int, partition_method: str, checkpoint_interval: int):
        topology = PipeModelDataParallelTopology(num_pp=layout.pp, num_mp=layout.tp, num_dp=layout.dp)
        module = build_pipeline_module(config, topology, partition_method, checkpoint_interval)
        load_mamba_state_dict(module, initial_state(config, seed), config)
        self.engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
            model=module, optimizer=_optimizer(module, settings), lr_scheduler=settings.schedule.scheduler,
            config=engine_config)
        self.dp_rank = self.engine.grid.get_data_parallel_rank()
        self.module = module
        if not self.engine.zero_optimization():
            clipping.install(self.engine, self.engine.grid.get_slice_parallel_rank(),
                             self.engine.grid.get_model_parallel_group())

    def train_step(self, micro_batches: list) -> float:
        """One optimizer step over this rank's micro-batches; the loss averaged over the global batch."""
        return self.engine.train_batch(iter(micro_batches)).item()

    def eval_loss(self, micro_batches: list) -> float:
        loss = self.engine.eval_batch(iter(micro_batches), num_micro_batches=len(micro_batches))
        return loss.item()


class PlainTrainer:
    """Layouts with pp = 1."""

    def __init__(self, layout: Layout, config: MambaConfig, engine_config: dict, settings: OptimizerSettings,
                 seed: int, checkpoint_interval: int):
        model = MambaLM(config)
        model.load_state_dict(initial_state(config, seed))
        module = PlainLM(model, checkpoint_interval).to(get_accelerator().current_device_name())
        self.engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
            model=module, optimizer=_optimizer(module, settings), lr_scheduler=settings.schedule.scheduler,
            config=engine_config)
        self.dp_rank = dist.get_rank()
        self.module = module
        self.device = self.engine.device
        if not self.engine.zero_optimization():
            clipping.install(self.engine, tp_rank=0, model_parallel_group=None)

    def _mean_over_data_parallel(self, losses: list) -> float:
        loss = torch.stack(losses).mean()
        dist.all_reduce(loss)
        return (loss / dist.get_world_size()).item()

    def train_step(self, micro_batches: list) -> float:
        losses = []
        for inputs, labels in micro_batches:
            loss = self.engine(inputs.to(self.device), labels.to(self.device))
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.detach().float())
        return self._mean_over_data_parallel(losses)

    @torch.no_grad()
    def eval_loss(self, micro_batches: list) -> float:
        self.engine.eval()
        losses = [self.engine(x.to(self.device), y.to(self.device)).float() for x, y in micro_batches]
        self.engine.train()
        return self._mean_over_data_parallel(losses)


def build_trainer(layout: Layout, config: MambaConfig, engine_config: dict, settings: OptimizerSettings,
                  seed: int, partition_method: str, checkpoint_interval: int):
    if layout.pp > 1:
        return PipelineTrainer(layout, config, engine_config, settings, seed, partition_method, checkpoint_interval)
    return PlainTrainer(layout, config, engine_config, settings, seed, checkpoint_interval)
