"""Every DeepSpeed 0.19.8 internal the trainer relies on, in one module.

Private or undocumented attributes of DeepSpeed's engine, ZeRO optimizers and parameters, the
engine methods we replace, and the torch internals those paths hand to DeepSpeed, each behind one
small function. tests/pipelines/test_deepspeed_internals.py checks that each still has the shape used
here: upgrading DeepSpeed means reading this file and running that test.
"""

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import groups as deepspeed_groups


def replace_fp32_clipping(engine, clip: Callable[[], None]) -> None:
    """`DeepSpeedEngine.clip_fp32_gradients`, which `_take_model_step` calls without ZeRO, replaced by `clip`."""
    engine.clip_fp32_gradients = clip


def set_global_grad_norm(engine, norm: torch.Tensor) -> None:
    """`DeepSpeedEngine._global_grad_norm`, what `get_global_grad_norm()` returns (stage 0 never sets it)."""
    engine._global_grad_norm = norm


def skipped_steps(engine) -> int:
    """`DeepSpeedEngine.skipped_steps`: the steps its optimizer skipped on overflow (there is no getter)."""
    return engine.skipped_steps


def set_global_steps(engine, steps: int) -> None:
    """`DeepSpeedEngine.global_steps`, its optimizer-step counter, set when resuming from our own checkpoint."""
    engine.global_steps = steps


def wrap_optimizer_step(optimizer: torch.optim.Optimizer, before: Callable[[], None]) -> None:
    """`optimizer.step`, which `DeepSpeedEngine._take_model_step` calls without ZeRO, made to run `before()` first."""
    original = optimizer.step

    def step(*args, **kwargs):
        before()
        return original(*args, **kwargs)

    optimizer.step = step


def set_found_inf(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """torch fused AdamW's `found_inf` (as GradScaler sets it): its step skips the update where the flag is 1."""
    optimizer.found_inf = flag


def is_zero_optimizer(optimizer) -> bool:
    """Whether `optimizer` is DeepSpeed's ZeRO-1/2 `DeepSpeedZeroOptimizer` (it has the two fields below)."""
    return hasattr(optimizer, "bit16_groups") and hasattr(optimizer, "single_partition_of_fp32_groups")


def zero_param_groups(zero) -> list:
    """`DeepSpeedZeroOptimizer.bit16_groups`: each group's model parameters (its inner optimizer steps flat tensors)."""
    return zero.bit16_groups


def zero_flat_masters(zero) -> list:
    """`DeepSpeedZeroOptimizer.single_partition_of_fp32_groups`: this rank's flat fp32 master of each group."""
    return zero.single_partition_of_fp32_groups


def link_zero_moments(zero) -> None:
    """`deepspeed.utils.lazy_init_hp_params_optimizer_state` for every group: links each parameter's fragment to the
    flat Adam moments (DeepSpeed 0.19.8 links only the first group by itself)."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    for lp_group, flat in zip(zero_param_groups(zero), zero_flat_masters(zero)):
        lazy_init_hp_params_optimizer_state(lp_group, flat, zero.optimizer.state)


def zero_fragment(param):
    """`param._hp_mapping`: the `tensor_fragment` of `param` in this rank's ZeRO-1/2 partition, None if it has none."""
    return param._hp_mapping


def fragment_range(fragment) -> tuple[int, int]:
    """`tensor_fragment.lp_fragment_address`: the fragment's [start, end) in the parameter's flattened elements."""
    start = fragment.lp_fragment_address.start
    return start, start + fragment.lp_fragment_address.numel


def fragment_values(fragment, key: Optional[str] = None) -> torch.Tensor:
    """`tensor_fragment.get_hp_fragment`: the fragment's fp32 master (key None) or its optimizer state `key`."""
    return fragment.get_hp_fragment(key)


def zero3_masters(optimizer) -> list:
    """(fp32 master, parameter partition) of each group: `DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat`
    and `fp16_partitioned_groups_flat` (a partition is None when swapped to NVMe)."""
    return list(zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_partitioned_groups_flat))


def zero3_partition(param) -> tuple[torch.Tensor, int, int]:
    """(`param.ds_tensor`, the [start, end) it covers in the flattened parameter): this rank's ZeRO-3 partition,
    `ds_tensor.ds_numel` elements per rank of `param.ds_process_group` (the last one padded)."""
    part = param.ds_tensor
    start = part.ds_numel * dist.get_rank(group=param.ds_process_group)
    return part, start, start + part.ds_numel


def full_shape(param) -> torch.Size:
    """`param.ds_shape`, a ZeRO-3 parameter's full shape (its own is empty); any other parameter's shape."""
    return getattr(param, "ds_shape", param.shape)


def full_numel(param) -> int:
    """`param.ds_numel`, a ZeRO-3 parameter's full element count (its own is 0); any other parameter's."""
    return getattr(param, "ds_numel", param.numel())


def is_pipe_replicated(param) -> bool:
    """`ds_pipe_replicated`: `PipelineModule`'s mark on a tied weight's copy on a stage other than the first owner."""
    return getattr(param, "ds_pipe_replicated", False)


def set_scheduler_lrs(scheduler, lrs: list) -> None:
    """torch `LRScheduler._last_lr`, what `get_last_lr()` returns (to our logs and DeepSpeed's), set on restore."""
    scheduler._last_lr = lrs


def _partition_at_bounds(self, method):
    """`PipelineModule._partition_layers(method)`, which its __init__ calls with `partition_method` to set `parts`
    (each stage's first layer and the end) and this rank's layers (`_set_bounds`), given the bounds as the method."""
    self.parts = list(method)
    stage = self._topo.get_coord(self.global_rank).pipe
    self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])


def pipeline_module_with_stages(module_class: type, bounds: list, **settings) -> PipelineModule:
    """A `module_class` (a PipelineModule; `settings`: its other arguments) whose stage s runs layers
    [bounds[s], bounds[s + 1])."""
    with_stages = type(
        f"{module_class.__name__}WithStages", (module_class,), {"_partition_layers": _partition_at_bounds}
    )
    return with_stages(partition_method=bounds, **settings)


def stage_layers(module: PipelineModule) -> list:
    """`PipelineModule.forward_funcs`: this stage's layers in order, each a callable on what the one before returns
    (a tied layer's `forward_fn` bound to the tied module)."""
    return module.forward_funcs


def expert_group_name(ep_size: int) -> str:
    """The name DeepSpeed's MoE code gives the expert groups of expert-parallel size `ep_size`."""
    return f"ep_size_{ep_size}"


def register_expert_groups(ep_size: int, ep_group: dist.ProcessGroup, edp_group: dist.ProcessGroup) -> None:
    """This rank's expert-parallel and expert-data-parallel groups put where DeepSpeed's engine and ZeRO look them up
    (`deepspeed.utils.groups._EXPERT_PARALLEL_GROUP` / `_EXPERT_DATA_PARALLEL_GROUP` and their `_RANKS`, by name)."""
    name = expert_group_name(ep_size)
    for groups, ranks, group in (
        (deepspeed_groups._EXPERT_PARALLEL_GROUP, deepspeed_groups._EXPERT_PARALLEL_GROUP_RANKS, ep_group),
        (deepspeed_groups._EXPERT_DATA_PARALLEL_GROUP, deepspeed_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS, edp_group),
    ):
        groups[name] = group
        ranks[name] = dist.get_process_group_ranks(group)


def mark_expert_parameters(params: list, ep_size: int) -> None:
    """DeepSpeed's marks of an expert parameter (`allreduce` False, `group_name`, as `deepspeed.moe` sets them):
    its gradient is reduced, and its ZeRO partition taken, over the expert-data-parallel group of that name."""
    for p in params:
        p.allreduce = False
        p.group_name = expert_group_name(ep_size)


def expert_param_groups(param_groups: list, is_expert: Callable[[torch.nn.Parameter], bool], ep_size: int) -> list:
    """`param_groups` with each group's expert parameters moved to a group of their own marked as DeepSpeed's MoE
    groups (`moe` True, `name`), which its ZeRO optimizer partitions over the expert-data-parallel group."""
    out = []
    for group in param_groups:
        experts = [p for p in group["params"] if is_expert(p)]
        out.append({**group, "params": [p for p in group["params"] if not is_expert(p)]})
        if experts:
            out.append({**group, "params": experts, "moe": True, "name": expert_group_name(ep_size)})
    return out


@contextlib.contextmanager
def engines_with_experts() -> Iterator[None]:
    """Engines built inside (`deepspeed.initialize`) take the model to hold MoE layers (`has_moe_layers`), so that
    ZeRO and the plain reduction treat the marked expert parameters apart. DeepSpeed sets the flag in
    `DeepSpeedEngine._configure_distributed_model` only for its own MoE layer classes; it is set after that."""
    original = DeepSpeedEngine._configure_distributed_model

    def configure(engine, model):
        original(engine, model)
        engine.has_moe_layers = True

    DeepSpeedEngine._configure_distributed_model = configure
    try:
        yield
    finally:
        DeepSpeedEngine._configure_distributed_model = original
