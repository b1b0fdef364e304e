"""Measure what a training step costs beyond the layers' kernels, the links' α–β and the optimizer's pass:
the trainer's and DeepSpeed's engine's calls per micro-batch and per step, how much slower the layers run
inside a whole step than alone, how much slower again while the node's other ranks compute, and what
each of our TP and CP collectives costs inside a step beyond its ring (its autograd function, its
reshapes, the wait for the slower peer).

Spawned ranks (gloo on the CPU, NCCL on GPUs) build the model's trainer as launch/train.py does and time
its steps. A step of m micro-batches is fitted as S + m x M. On one rank, at ZeRO 0 to 2 with 1 and SIZES
micro-batches of the batch asked, and at ZeRO 0 with one of SIZES times it: M against what the layer fits
predict at the two micro-batch sizes gives the whole step's scale over the fits and the engine's cost per
micro-batch; S less the optimizer's pass the engine's cost per step. Given two ranks, data parallel 2
(ZeRO 0) gives the shared node's scale, and at TP 2 with sequence parallelism and at CP 2 what M has
beyond the prediction is shared among the group's collectives of a micro-batch: their cost per call.
"""

import dataclasses
import functools
import os

import torch

from megamamba.config import MambaConfig
from megamamba.model.layer_types import layer_type
from megamamba.model.layer_types.costs import RankShape
from megamamba.model.layers import layer_kinds
from megamamba.pipelines.config.layout import Layout, engine_config
from megamamba.pipelines.planner.layer_costs import loss_work
from megamamba.pipelines.planner.profile import EngineCost, Profile
from megamamba.pipelines.planner.step_time import Grid, layer_time, optimizer_seconds
from megamamba.pipelines.planner.timing import on_ranks, seconds

SIZES = 4  # micro-batches of the longer step
ONE_RANK = [(1, 1, zero, 1) for zero in (0, 1, 2)] + [(1, 1, 0, SIZES)]  # (tp, cp, ZeRO stage, batch multiple)
# TP last: DeepSpeed keeps the TP trainer's mpu for the process's later engines
TWO_RANKS = [(1, 2, 0, 1), (1, 1, 0, 1), (2, 1, 0, 1)]


def _step_seconds(
    rank: int, world: int, port: int, model: MambaConfig, batch: int, seqlen: int, layouts: list, results
) -> None:
    """A spawned rank: the median step seconds of each (tp, cp, ZeRO stage, batch multiple) of `layouts` with 1
    and SIZES micro-batches (1 only for a multiple above 1); rank 0 reports them."""
    from megamamba.parallel.groups import init_distributed, shutdown_distributed
    from megamamba.pipelines.loop.engine import OptimizerSettings, build_trainer
    from megamamba.pipelines.stages.partition import DEFAULT_PARTITION
    from megamamba.schedule.lr_schedule import LRSchedule

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    init_distributed()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    settings = OptimizerSettings(LRSchedule(1e-4, 1e-5, 0, 10**6), 0.1, (0.9, 0.95))
    samples = {}
    for tp, cp, zero, multiple in layouts:
        micro = multiple * batch
        ids = torch.randint(0, model.vocab_size, (micro, seqlen // cp), device=device)  # this rank's slice
        for micro_batches in (1, SIZES) if multiple == 1 else (1,):
            layout = Layout(world, world // (tp * cp), tp, 1, micro, micro_batches, cp)
            ds = {"zero_optimization": {"stage": zero}, "bf16": {"enabled": cuda}, "steps_per_print": 10**9}
            trainer = build_trainer(
                layout,
                model,
                engine_config(ds, layout, None, tp > 1),
                settings,
                0,
                DEFAULT_PARTITION,
                0,
                tp > 1,
                seq_length=seqlen,
            )
            step = functools.partial(trainer.train_step, [(ids, ids, None)] * micro_batches)
            samples[tp, cp, zero, multiple, micro_batches] = seconds(step, device)
    if rank == 0:
        results.put(samples)
    shutdown_distributed()


def _per_micro_batch(samples: dict, tp: int, cp: int, zero: int) -> float:
    return max(0.0, (samples[tp, cp, zero, 1, SIZES] - samples[tp, cp, zero, 1, 1]) / (SIZES - 1))


def _micro_batch_work(model: MambaConfig, batch: int, seqlen: int, tp: int, cp: int) -> list:
    """(kind, LayerWork) of every layer of the list and the loss, for one micro-batch at TP `tp`, CP `cp`."""
    shape = RankShape(model, batch, seqlen, tp, cp, tp > 1, act=2 if torch.cuda.is_available() else 4)
    return [(kind, layer_type(kind).work(shape)) for kind in layer_kinds(model)] + [("loss", loss_work(shape))]


def predicted_micro_batch(
    model: MambaConfig, batch: int, seqlen: int, profile: Profile, tp: int = 1, cp: int = 1, dp: int = 1
) -> float:
    """A micro-batch's layers and loss, forward and backward with their collectives, as the planner predicts
    (on one node of dp x cp x tp ranks)."""
    grid = Grid(dp, cp, tp, 1, dp * tp * cp)
    return sum(
        layer_time(kind, work, grid, profile, False).total
        for kind, work in _micro_batch_work(model, batch, seqlen, tp, cp)
    )


def parameter_count(model: MambaConfig) -> int:
    from megamamba.model.lm import MambaLM

    with torch.device("meta"):
        return sum(p.numel() for p in MambaLM(model).parameters())


def one_rank_costs(model: MambaConfig, batch: int, seqlen: int, profile: Profile) -> Profile:
    """`profile` with its model scale and its engine costs per ZeRO stage ("0", "1", "2"), fitted against its
    layer fits and optimizer pass."""
    samples = on_ranks(_step_seconds, 1, model, batch, seqlen, ONE_RANK)
    small, large = (predicted_micro_batch(model, b, seqlen, profile) for b in (batch, SIZES * batch))
    step = {zero: samples[1, 1, zero, 1, 1] - _per_micro_batch(samples, 1, 1, zero) for zero in (0, 1, 2)}
    grows = samples[1, 1, 0, SIZES, 1] - step[0] - _per_micro_batch(samples, 1, 1, 0)
    scale = grows / (large - small) if grows > 0 and large > small else 1.0
    optimizer = optimizer_seconds(parameter_count(model), profile)
    engine = {
        str(zero): EngineCost(
            max(0.0, _per_micro_batch(samples, 1, 1, zero) - scale * small), max(0.0, step[zero] - optimizer)
        )
        for zero in (0, 1, 2)
    }
    return dataclasses.replace(profile, model_scale=scale, engine=engine)


def two_rank_costs(model: MambaConfig, batch: int, seqlen: int, profile: Profile) -> Profile:
    """`profile` with its shared node's scale and its TP and CP collectives' cost per call, from steps on two
    ranks against `profile` (with its one-rank costs)."""
    samples = on_ranks(_step_seconds, 2, model, batch, seqlen, TWO_RANKS)
    alone = predicted_micro_batch(model, batch, seqlen, profile)
    micro = profile.engine_cost(0).micro_batch_s
    shared = (_per_micro_batch(samples, 1, 1, 0) - micro) / alone if alone > 0 else 1.0
    profile = dataclasses.replace(profile, shared_node_scale=max(1.0, shared))
    calls = {}
    for tp, cp, zero, _ in TWO_RANKS:
        if tp == cp == 1:
            continue
        group = "tp" if tp > 1 else "cp"
        count = sum(
            c.group == group for _, work in _micro_batch_work(model, batch, seqlen, tp, cp) for c in work.collectives
        )
        predicted = predicted_micro_batch(model, batch, seqlen, profile, tp, cp) + micro
        calls[group] = max(0.0, _per_micro_batch(samples, tp, cp, zero) - predicted) / count if count else 0.0
    return dataclasses.replace(profile, collective_call_s=calls)
