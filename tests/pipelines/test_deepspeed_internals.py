"""Each DeepSpeed internal that pipelines/deepspeed_internals.py touches still has the shape it relies on.

A failure names the DeepSpeed (or torch) version and the internal that moved: read that function of
pipelines/deepspeed_internals.py against the new version. Checked on DeepSpeed's classes and source
and on small torch objects, without building an engine.
"""

import dataclasses
import inspect

import deepspeed
import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.module import PipelineModule
from deepspeed.runtime.zero.partition_parameters import Init
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import lazy_init_hp_params_optimizer_state
from deepspeed.utils.tensor_fragment import fragment_address, tensor_fragment

from megamamba.pipelines import deepspeed_internals as internals


def moved(internal: str) -> str:
    return (
        f"DeepSpeed {deepspeed.__version__} (torch {torch.__version__}): {internal} is not what "
        "pipelines/deepspeed_internals.py relies on (written against DeepSpeed 0.19.8)"
    )


def assert_source_has(obj, code: str, internal: str) -> None:
    assert code in inspect.getsource(obj), moved(internal)


def _fragment(numel: int, start: int, flat: torch.Tensor) -> tensor_fragment:
    return tensor_fragment(
        lp_fragment=torch.zeros(numel),
        lp_fragment_address=fragment_address(numel, start),
        hp_fragment=flat.narrow(0, 0, numel),
        hp_fragment_address=fragment_address(numel, 0),
        gradient_dict={},
        offload_gradient_dict={},
        use_offload=False,
        param_group_index=0,
    )


def test_the_engine_clips_through_clip_fp32_gradients_without_zero():
    assert_source_has(
        DeepSpeedEngine._take_model_step,
        "self.clip_fp32_gradients()",
        "DeepSpeedEngine._take_model_step calling self.clip_fp32_gradients()",
    )


def test_get_global_grad_norm_returns_global_grad_norm():
    assert_source_has(
        DeepSpeedEngine.get_global_grad_norm,
        "return self._global_grad_norm",
        "DeepSpeedEngine._global_grad_norm returned by get_global_grad_norm()",
    )


def test_the_engine_counts_overflow_steps_in_skipped_steps():
    assert_source_has(
        DeepSpeedEngine._take_model_step,
        "self.skipped_steps += 1",
        "DeepSpeedEngine.skipped_steps counted in _take_model_step",
    )


def test_the_engine_counts_optimizer_steps_in_global_steps():
    assert_source_has(DeepSpeedEngine.__init__, "self.global_steps = 0", "DeepSpeedEngine.global_steps")
    assert_source_has(
        DeepSpeedEngine._take_model_step,
        "self.global_steps += 1",
        "DeepSpeedEngine.global_steps advanced in _take_model_step",
    )


def test_the_engine_steps_through_the_optimizers_step_attribute():
    assert_source_has(
        DeepSpeedEngine._take_model_step,
        "self.optimizer.step()",
        "DeepSpeedEngine._take_model_step calling self.optimizer.step()",
    )


def test_a_wrapped_optimizer_step_runs_the_hook_first_then_the_step():
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    optimizer = torch.optim.SGD([param], lr=1.0)
    seen = []
    internals.wrap_optimizer_step(optimizer, lambda: seen.append(param.detach().clone()))
    optimizer.step()
    assert torch.equal(seen[0], torch.ones(2)) and torch.equal(param.detach(), torch.zeros(2))


def test_fused_adamw_skips_its_update_where_found_inf_is_set():
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = torch.optim.AdamW([param], lr=1.0, fused=True)
    internals.set_found_inf(optimizer, torch.ones(()))
    optimizer.step()
    assert torch.equal(param.detach(), torch.ones(3)), moved("torch fused AdamW's found_inf")
    internals.set_found_inf(optimizer, torch.zeros(()))
    optimizer.step()
    assert not torch.equal(param.detach(), torch.ones(3)), moved("torch fused AdamW's found_inf")


def test_the_zero_optimizer_keeps_bit16_groups_and_its_flat_fp32_partitions():
    for field in ("bit16_groups", "single_partition_of_fp32_groups"):
        assert_source_has(DeepSpeedZeroOptimizer.__init__, f"self.{field} = []", f"DeepSpeedZeroOptimizer.{field}")


def test_the_zero_optimizer_maps_each_parameter_to_its_fragment_in_hp_mapping():
    assert_source_has(
        deepspeed.utils.mixed_precision_linkage.link_hp_params,
        "lp_param._hp_mapping = ",
        "param._hp_mapping set by link_hp_params",
    )


def test_a_fragment_gives_its_flat_range_master_and_linked_moments():
    flat = torch.arange(6.0)
    param = torch.nn.Parameter(torch.zeros(4))
    param._hp_mapping = _fragment(numel=3, start=1, flat=flat)
    lazy_init_hp_params_optimizer_state([param], flat, {flat: {"exp_avg": flat * 10}})
    fragment = internals.zero_fragment(param)
    assert internals.fragment_range(fragment) == (1, 4), moved("tensor_fragment.lp_fragment_address")
    assert torch.equal(internals.fragment_values(fragment), flat[:3]), moved("tensor_fragment.get_hp_fragment()")
    assert torch.equal(internals.fragment_values(fragment, "exp_avg"), flat[:3] * 10), moved(
        "lazy_init_hp_params_optimizer_state linking tensor_fragment.get_hp_fragment(key)"
    )


def test_a_fragment_is_the_dataclass_the_adapter_reads():
    fields = {f.name for f in dataclasses.fields(tensor_fragment)}
    assert {"lp_fragment_address", "hp_fragment"} <= fields, moved("tensor_fragment fields")
    assert {f.name for f in dataclasses.fields(fragment_address)} == {"numel", "start"}, moved("fragment_address")


def test_zero3_keeps_flat_fp32_masters_beside_its_parameter_partitions():
    for field in ("fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat"):
        assert_source_has(
            DeepSpeedZeroOptimizer_Stage3.__init__, f"self.{field} = []", f"DeepSpeedZeroOptimizer_Stage3.{field}"
        )


def test_zero3_parameters_carry_their_full_shape_size_group_and_partition():
    for field in ("ds_shape", "ds_numel", "ds_tensor", "ds_process_group"):
        assert_source_has(Init._convert_to_deepspeed_param, f"param.{field} = ", f"ZeRO-3 param.{field}")
    assert_source_has(Init, "param.ds_tensor.ds_numel = partition_size", "ZeRO-3 param.ds_tensor.ds_numel")


def test_the_pipeline_module_marks_a_tied_weights_other_copies_pipe_replicated():
    assert_source_has(
        PipelineModule._index_tied_modules, "p.ds_pipe_replicated = True", "PipelineModule's ds_pipe_replicated"
    )


def test_setting_a_schedulers_last_lr_is_what_get_last_lr_returns():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    internals.set_scheduler_lrs(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25], moved("torch LRScheduler._last_lr")


def test_the_pipeline_module_takes_its_stages_from_partition_layers():
    """`pipeline_module_with_stages` replaces `_partition_layers`, which __init__ calls with the partition method
    and which sets `parts` (what `partitions()` and `stage_owner` read) and this rank's layers."""
    assert_source_has(
        PipelineModule.__init__,
        "self._partition_layers(method=partition_method)",
        "PipelineModule.__init__ calling _partition_layers(method=partition_method)",
    )
    for code in ("self.parts = ", "self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])"):
        assert_source_has(PipelineModule._partition_layers, code, f"PipelineModule._partition_layers: {code}")
    assert_source_has(PipelineModule.partitions, "return self.parts", "PipelineModule.partitions()")
    assert_source_has(PipelineModule._set_bounds, "self._local_start = start", "PipelineModule._set_bounds")
    source = inspect.getsource(PipelineModule.__init__)
    for field in ("self._topo = ", "self.global_rank = "):  # read by our _partition_layers: set before it runs
        assert field in source and source.index(field) < source.index("self._partition_layers("), moved(
            f"PipelineModule.{field[5:-3]} set before _partition_layers"
        )


def test_the_pipeline_module_keeps_its_stages_callables_in_forward_funcs():
    """`stage_layers` reads `forward_funcs`: the built layers in order, a tied layer's forward_fn bound to the
    tied module, and nothing else (the forward runs exactly these)."""
    for code in (
        "self.forward_funcs.append(layer)",
        "self.forward_funcs.append(partial(layer.forward_fn, self.tied_modules[layer.key]))",
        "self.forward_funcs.append(module)",
    ):
        assert_source_has(PipelineModule._build, code, f"PipelineModule._build: {code}")
    assert_source_has(PipelineModule.forward, "self.forward_funcs[start:end]", "PipelineModule.forward's layers")


def test_the_engine_looks_up_expert_groups_by_name_in_deepspeeds_group_registry():
    from deepspeed.utils import groups

    for registry in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP"):
        assert isinstance(getattr(groups, registry), dict), moved(f"deepspeed.utils.groups.{registry}")
        assert isinstance(getattr(groups, f"{registry}_RANKS"), dict), moved(f"deepspeed.utils.groups.{registry}_RANKS")
    assert_source_has(
        groups._get_expert_data_parallel_group, "_EXPERT_DATA_PARALLEL_GROUP[group_name]", "expert groups"
    )
    assert_source_has(
        DeepSpeedEngine._configure_distributed_model,
        "self.expert_data_parallel_group = groups._get_expert_data_parallel_group_dict()",
        "the engine reading the expert-data-parallel groups",
    )


def test_expert_parameters_are_the_ones_marked_not_allreduced_in_groups_of_their_own():
    from deepspeed.moe.utils import is_moe_param

    marked, plain = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    internals.mark_expert_parameters([marked], ep_size=2)
    assert is_moe_param(marked) and not is_moe_param(plain), moved("deepspeed.moe.utils.is_moe_param")
    assert marked.group_name == internals.expert_group_name(2)
    groups = internals.expert_param_groups(
        [{"params": [plain, marked], "weight_decay": 0.1}], lambda p: p is marked, ep_size=2
    )
    assert groups == [
        {"params": [plain], "weight_decay": 0.1},
        {"params": [marked], "weight_decay": 0.1, "moe": True, "name": "ep_size_2"},
    ]
    assert_source_has(DeepSpeedZeroOptimizer.is_moe_group, "'moe' in group and group['moe']", "ZeRO's MoE groups")
    assert_source_has(
        DeepSpeedZeroOptimizer._configure_moe_settings,
        "self.real_dp_process_group[i] = self.expert_dp_process_group[group['name']]",
        "ZeRO partitioning an MoE group over its expert-data-parallel group",
    )


def test_engines_built_with_experts_take_the_model_to_hold_moe_layers(monkeypatch):
    assert_source_has(DeepSpeedEngine.__init__, "self.has_moe_layers = False", "DeepSpeedEngine.has_moe_layers")
    init = inspect.getsource(DeepSpeedEngine.__init__)
    configured, optimizer = init.find("self._configure_distributed_model("), init.find("self._configure_optimizer(")
    assert 0 <= configured < optimizer, moved("the engine configuring its model before its optimizer")
    calls = []
    stub = lambda engine, model: calls.append(model)  # noqa: E731
    monkeypatch.setattr(DeepSpeedEngine, "_configure_distributed_model", stub)
    engine = object.__new__(DeepSpeedEngine)
    with internals.engines_with_experts():
        DeepSpeedEngine._configure_distributed_model(engine, "model")
    assert calls == ["model"] and engine.has_moe_layers
    assert DeepSpeedEngine._configure_distributed_model is stub
