"""Global gradient-norm clipping for engines without ZeRO (stage 0).

With ZeRO 1-3 DeepSpeed's optimizer computes the global norm right: every parameter once, the
pipeline's second copy of a tied weight (`ds_pipe_replicated`) and TP-replicated parameters on
TP ranks > 0 left out. Its stage-0 path (`engine.clip_fp32_gradients` in 0.19.8) does not: it
counts the tied embedding twice and, under the pipeline grid, only the first stage's
non-TP parameters, and it does not record the norm for logging. `install` replaces that path on
an engine with this one, which counts each parameter once, sums over the model-parallel group
(pipeline stages x TP ranks) and records the norm where `engine.get_global_grad_norm()` reads it.
Data-parallel replicas hold identical, already averaged gradients when it runs, but for experts split over an
expert-parallel group: each rank holds its own experts', summed over that group first.
"""

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.utils import is_model_parallel_parameter

from megamamba.parallel.expert.expert_parallel import holds_split_experts
from megamamba.pipelines.deepspeed_internals import is_pipe_replicated, replace_fp32_clipping, set_global_grad_norm
from megamamba.pipelines.loop.agreement import device


def counted_here(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank's copy of `param` enters the global norm."""
    if is_pipe_replicated(param):
        return False
    return tp_rank == 0 or is_model_parallel_parameter(param)


def global_grad_norm(
    params: Iterable[torch.nn.Parameter],
    tp_rank: int,
    model_parallel_group: Optional[dist.ProcessGroup],
    expert_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """sqrt of the sum of squared gradients over every parameter of the model, each counted once."""
    params = [p for p in params if p.grad is not None]
    at = params[0].grad.device if params else device()
    total, experts = torch.zeros((), dtype=torch.float64, device=at), torch.zeros((), dtype=torch.float64, device=at)
    for p in params:
        if counted_here(p, tp_rank):
            (experts if holds_split_experts(p) else total).add_(p.grad.detach().double().pow(2).sum())
    if expert_group is not None:
        dist.all_reduce(experts, group=expert_group)
    total += experts
    if model_parallel_group is not None:
        dist.all_reduce(total, group=model_parallel_group)
    return total.sqrt()


def clip_(
    params: Iterable[torch.nn.Parameter],
    max_norm: float,
    tp_rank: int,
    model_parallel_group: Optional[dist.ProcessGroup],
    expert_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / norm) on the device; returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params, tp_rank, model_parallel_group, expert_group)
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coefficient.to(p.grad.dtype))
    return norm


def install(
    engine,
    tp_rank: int,
    model_parallel_group: Optional[dist.ProcessGroup],
    expert_group: Optional[dist.ProcessGroup] = None,
) -> None:
    """Make a ZeRO-0 engine clip (and record, as a device tensor read at log steps) the correct global norm."""

    def clip_and_record():
        norm = clip_(
            engine.module.parameters(), engine.gradient_clipping(), tp_rank, model_parallel_group, expert_group
        )
        set_global_grad_norm(engine, norm)

    replace_fp32_clipping(engine, clip_and_record)
