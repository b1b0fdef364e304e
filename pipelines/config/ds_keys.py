"""Every key of the DeepSpeed JSON checked against what DeepSpeed 0.19.8 reads, before any process group.

DeepSpeed ignores a key it does not read, so a typo (`zero_optimisation`) silently trains at ZeRO 0, and
it reads most values unchecked, so `"gradient_clipping": "1.0"` fails at step 0 with a traceback. Here
an unknown key is refused with its path and the closest key DeepSpeed reads there, a mistyped value with
its path and the type it must have:
  - blocks DeepSpeed reads through its pydantic models (zero_optimization, fp16, the monitors,
    comms_logger, timers.throughput, ...) are validated through those models: the keys, their aliases
    ("stage3_max_live_parameters") and the types are DeepSpeed's own;
  - the top-level keys and the blocks DeepSpeed reads key by key come from the tables below, each
    naming the DeepSpeed source it mirrors.
What the blocks we translate hold (optimizer and scheduler params, bf16) and pipeline's
activation_checkpoint_interval are checked where they are translated or refused, with those messages.
"""

import difflib
import json
from typing import Any, Optional, Union, get_args

import deepspeed
import pydantic
from deepspeed.comm.config import CommsLoggerConfig
from deepspeed.compile.config import CompileConfig
from deepspeed.inference.config import WeightQuantConfig
from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
from deepspeed.runtime.config import HybridEngineConfig
from deepspeed.runtime.precision_config import DeepSpeedFP16Config
from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.utils.config import DeepSpeedThroughputTimerConfig

from megamamba.errors import LayoutError

_KINDS: dict = {
    "true or false": lambda v: isinstance(v, bool),
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "a string": lambda v: isinstance(v, str),
    "a list": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}
BOOL = ("true or false",)
INT = ("an integer",)
NUMBER = ("a number",)
STR = ("a string",)
ANY = ()  # DeepSpeed reads the value as it is (a free-form block), or we check it elsewhere


def _or_null(kinds: tuple) -> tuple:
    return (*kinds, "null")


# A block's spec: a table {key: spec}, a DeepSpeed pydantic model, a tuple of _KINDS, or ANY.
Spec = Union[dict, type, tuple]

# deepspeed/runtime/config.py get_pipeline_config's defaults, and use_reentrant (runtime/pipe/engine.py)
PIPELINE = {
    "stages": ("an integer", "a string"),
    "partition": STR,
    "seed_layers": BOOL,
    "activation_checkpoint_interval": ANY,  # refused by layout.check_run whatever its value
    "pipe_partitioned": BOOL,
    "grad_partitioned": BOOL,
    "use_reentrant": _or_null(BOOL),
}
# deepspeed/runtime/activation_checkpointing/config.py (ACT_CHKPT_*)
ACTIVATION_CHECKPOINTING = {
    "partition_activations": BOOL,
    "number_checkpoints": _or_null(INT),
    "contiguous_memory_optimization": BOOL,
    "synchronize_checkpoint_boundary": BOOL,
    "profile": BOOL,
    "cpu_checkpointing": BOOL,
}
# deepspeed/profiling/constants.py (FLOPS_PROFILER_*)
FLOPS_PROFILER = {
    "enabled": BOOL,
    "recompute_fwd_factor": NUMBER,
    "profile_step": INT,
    "module_depth": INT,
    "top_modules": INT,
    "detailed": BOOL,
    "output_file": _or_null(STR),
}
# deepspeed/runtime/constants.py (TORCH_AUTOCAST_*)
TORCH_AUTOCAST = {"enabled": BOOL, "dtype": STR, "lower_precision_safe_modules": ("a list",)}
# deepspeed/runtime/config.py get_checkpoint_params and runtime/model_checkpointing/constants.py (CHECKPOINT_*)
CHECKPOINT = {
    "tag_validation": STR,
    "load_universal": BOOL,
    "use_node_local_storage": BOOL,
    "parallel_write": {"pipeline_stage": BOOL},
    "checkpoint_serialization": BOOL,
    "writer": {
        "type": STR,
        "io_buffer_size": NUMBER,
        "io_buffer_double": BOOL,
        "show_statistics": BOOL,
        "data_parallel": _or_null(STR),
        "decoupled": BOOL,
        "io_multiplier": NUMBER,
    },
}
# deepspeed/runtime/constants.py (DATA_TYPES)
DATA_TYPES = {
    "grad_accum_dtype": _or_null(STR),
    "param_dtype": _or_null(STR),
    "buffer_dtype": _or_null(STR),
    "keep_in_fp32_modules": ("a string", "a list"),
}
# deepspeed/runtime/swap_tensor/constants.py (AIO_*)
AIO = {
    "block_size": INT,
    "queue_depth": INT,
    "intra_op_parallelism": INT,
    "single_submit": BOOL,
    "overlap_events": BOOL,
    "use_gds": BOOL,
}
# The keys DeepSpeedConfig._initialize_params (deepspeed/runtime/config.py, constants in runtime/constants.py)
# and deepspeed.initialize read at the top level; a default of None in DeepSpeed allows null.
TOP_LEVEL: dict = {
    "train_batch_size": _or_null(INT),
    "train_micro_batch_size_per_gpu": _or_null(INT),
    "gradient_accumulation_steps": _or_null(INT),
    "managed_gradient_accumulation": BOOL,
    "steps_per_print": _or_null(INT),
    "dump_state": BOOL,
    "disable_python_gc": BOOL,
    "disable_allgather": BOOL,
    "communication_data_type": _or_null(STR),
    "seq_parallel_communication_data_type": _or_null(STR),
    "prescale_gradients": BOOL,
    "gradient_predivide_factor": NUMBER,
    "gradient_allreduce_op": STR,
    "gradient_clipping": NUMBER,
    "zero_allow_untested_optimizer": BOOL,
    "zero_force_ds_cpu_optimizer": BOOL,
    "wall_clock_breakdown": BOOL,
    "memory_breakdown": BOOL,
    "use_data_before_expert_parallelism": BOOL,
    "dataloader_drop_last": BOOL,
    "log_level": _or_null(STR),
    "vocabulary_size": _or_null(INT),
    "sequence_parallel_size": INT,  # deepspeed/__init__.py initialize
    "data_parallel_size": INT,  # deepspeed/__init__.py initialize
    "zero_optimization": DeepSpeedZeroConfig,
    "fp16": DeepSpeedFP16Config,
    "bf16": ANY,  # translated: layout.check_run
    "optimizer": {"type": ANY, "params": ANY, "legacy_fusion": BOOL},  # type and params: ds_translate
    "scheduler": {"type": ANY, "params": ANY},  # ds_translate
    "torch_autocast": TORCH_AUTOCAST,
    "pipeline": PIPELINE,
    "activation_checkpointing": ACTIVATION_CHECKPOINTING,
    "flops_profiler": FLOPS_PROFILER,
    "comms_logger": CommsLoggerConfig,
    "tensorboard": TensorBoardConfig,
    "wandb": WandbConfig,
    "csv_monitor": CSVConfig,
    "comet": CometConfig,
    "timers": {"throughput": DeepSpeedThroughputTimerConfig},  # deepspeed/utils/config.py get_timers_config
    "checkpoint": CHECKPOINT,
    "data_types": DATA_TYPES,
    "aio": AIO,
    "compile": CompileConfig,
    "hybrid_engine": HybridEngineConfig,
    "tensor_parallel": TPTrainingConfig,
    "weight_quantization": WeightQuantConfig,
    # features whose blocks DeepSpeed parses with free-form parts (metrics, presets, ...): not looked into
    "autotuning": ANY,
    "data_efficiency": ANY,
    "expert_parallel": ANY,
    "datastates_ckpt": ANY,
}
# DeepSpeed's older names that would bypass our handling of the new one (runtime/constants.py BFLOAT16_OLD)
RENAMED = {"bfloat16": "bf16"}


def check_deepspeed_keys(config: dict, where: str) -> None:
    """Refuse (LayoutError, one line starting with `where`) the first key DeepSpeed does not read, or value of
    a type it cannot take, anywhere in `config`."""
    for old, new in RENAMED.items():
        if old in config:
            raise LayoutError(f'{where}: "{old}" is DeepSpeed\'s old name of "{new}"; rename it "{new}"')
    problem = _check_table(config, TOP_LEVEL, ())
    if problem is not None:
        raise LayoutError(f"{where}: {problem}")


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _shown(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _unknown(path: tuple, known) -> str:
    """`path`'s last key is not one of `known`: the refusal, with the closest known key."""
    close = difflib.get_close_matches(str(path[-1]), sorted(known), n=1)
    if close:
        return f'unknown key "{_dotted(path)}"; did you mean "{_dotted((*path[:-1], close[0]))}"?'
    place = f'in "{_dotted(path[:-1])}"' if len(path) > 1 else "at the top level"
    return (
        f'unknown key "{_dotted(path)}": DeepSpeed {deepspeed.__version__} reads no such key {place} '
        "(https://www.deepspeed.ai/docs/config-json/); remove it"
    )


def _check(value: Any, spec: Spec, path: tuple) -> Optional[str]:
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f'"{_dotted(path)}" is {_shown(value)}; it must be an object'
        return _check_table(value, spec, path)
    if isinstance(spec, type) and issubclass(spec, pydantic.BaseModel):
        if not isinstance(value, dict):
            return f'"{_dotted(path)}" is {_shown(value)}; it must be an object'
        return _check_model(value, spec, path)
    if isinstance(spec, tuple) and spec and not any(_KINDS[kind](value) for kind in spec):
        return f'"{_dotted(path)}" is {_shown(value)}; it must be {" or ".join(spec)}'
    return None


def _check_table(block: dict, table: dict, path: tuple) -> Optional[str]:
    for key, value in block.items():
        if key not in table:
            return _unknown((*path, key), table)
        problem = _check(value, table[key], (*path, key))
        if problem is not None:
            return problem
    return None


def _field_names(model: type) -> set:
    """The keys a pydantic model takes: its field names and their aliases (DeepSpeed's models take both)."""
    fields = model.model_fields  # type: ignore[attr-defined]
    return set(fields) | {f.alias for f in fields.values() if f.alias}


def _models_in(annotation: Any) -> list:
    """The pydantic models an annotation names (X, Optional[X], List[X], ...)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models_in(arg)]


def _model_at(model: type, loc: tuple) -> Optional[type]:
    """The model that reads the block at `loc` (a pydantic error location: keys, list indices and, inside a
    union, the model's name) within `model`; None if no single model does."""
    candidates = [model]
    for step in loc:
        named = [m for m in candidates if m.__name__ == step]
        if named:
            candidates = named
            continue
        if isinstance(step, int):
            continue
        if len(candidates) != 1:
            return None
        fields = candidates[0].model_fields  # type: ignore[attr-defined]
        field = next((f for name, f in fields.items() if step in (name, f.alias)), None)
        if field is None:
            return None
        candidates = _models_in(field.annotation)
    return candidates[0] if len(candidates) == 1 else None


def _check_model(block: dict, model: type, path: tuple) -> Optional[str]:
    """The block validated as DeepSpeed does (its model's constructor): the first unknown key, else the first
    value it refuses."""
    try:
        model(**block)
    except pydantic.ValidationError as e:
        errors = e.errors()
        extra = [err for err in errors if err["type"] == "extra_forbidden"]
        if extra:
            loc = tuple(extra[0]["loc"])
            owner = _model_at(model, loc[:-1])
            return _unknown((*path, *loc), _field_names(owner) if owner is not None else ())
        err = errors[0]
        return (
            f'"{_dotted((*path, *err["loc"]))}" is {_shown(err["input"])}; DeepSpeed {deepspeed.__version__} '
            f"refuses it: {err['msg']}"
        )
    except (AssertionError, ValueError) as e:
        return f'"{_dotted(path)}": DeepSpeed {deepspeed.__version__} refuses it: {e}'
    return None
