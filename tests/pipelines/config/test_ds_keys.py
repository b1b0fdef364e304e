"""A DeepSpeed JSON key DeepSpeed does not read, or a value of a type it cannot take, is one line at start-up
naming its path (and the closest key DeepSpeed reads), before any process group; DeepSpeed itself would
ignore the key or fail at step 0."""

import inspect
import json
import re

import deepspeed
import pytest
import torch.distributed as dist
from deepspeed.runtime.config import DeepSpeedConfig, get_pipeline_config

from megamamba.pipelines.config import ds_keys
from megamamba.pipelines.config.layout import LayoutError
from megamamba.pipelines.config.run_plan import read_deepspeed_config
from train_entry import ROOT, load_train_script

BATCH = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}
TINY_MODEL = ROOT / "launch/models/tiny-mamba2.json"


def _refusal(tmp_path, config: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BATCH, **config}))
    with pytest.raises(LayoutError) as error:
        read_deepspeed_config(str(path))
    prefix = f"--deepspeed_config {str(path)!r}: "
    assert str(error.value).startswith(prefix) and "\n" not in str(error.value)
    return str(error.value)[len(prefix) :]


@pytest.mark.parametrize("path", sorted((ROOT / "launch/configs").glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_deepspeed_config_passes(path):
    assert read_deepspeed_config(str(path)) == json.loads(path.read_text())


@pytest.mark.parametrize(
    "config, key, closest",
    [
        ({"zero_optimisation": {"stage": 2}}, "zero_optimisation", "zero_optimization"),
        ({"gradient_clipin": 0.5}, "gradient_clipin", "gradient_clipping"),
        (
            {"zero_optimization": {"overlap_com": True}},
            "zero_optimization.overlap_com",
            "zero_optimization.overlap_comm",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memry": True}}},
            "zero_optimization.offload_optimizer.pin_memry",
            "zero_optimization.offload_optimizer.pin_memory",
        ),
        ({"pipeline": {"grad_partitoned": False}}, "pipeline.grad_partitoned", "pipeline.grad_partitioned"),
        ({"torch_autocast": {"enabled": True, "dtyp": "bf16"}}, "torch_autocast.dtyp", "torch_autocast.dtype"),
        ({"optimizer": {"type": "AdamW", "parms": {"lr": 1e-3}}}, "optimizer.parms", "optimizer.params"),
        ({"scheduler": {"typ": "WarmupLR"}}, "scheduler.typ", "scheduler.type"),
        (
            {"activation_checkpointing": {"partition_activation": True}},
            "activation_checkpointing.partition_activation",
            "activation_checkpointing.partition_activations",
        ),
        ({"tensorboard": {"enabled": True, "outputpath": "tb"}}, "tensorboard.outputpath", "tensorboard.output_path"),
        ({"csv_monitor": {"job_nam": "j"}}, "csv_monitor.job_nam", "csv_monitor.job_name"),
        ({"wandb": {"projct": "p"}}, "wandb.projct", "wandb.project"),
        ({"comms_logger": {"verbos": True}}, "comms_logger.verbos", "comms_logger.verbose"),
        ({"flops_profiler": {"profile_steps": 2}}, "flops_profiler.profile_steps", "flops_profiler.profile_step"),
        (
            {"timers": {"throughput": {"synchronised": False}}},
            "timers.throughput.synchronised",
            "timers.throughput.synchronized",
        ),
    ],
)
def test_a_misspelt_key_is_refused_with_its_path_and_the_closest_key(tmp_path, config, key, closest):
    assert _refusal(tmp_path, config) == f'unknown key "{key}"; did you mean "{closest}"?'


def test_a_key_with_no_close_name_is_refused_naming_where_deepspeed_reads_none(tmp_path):
    assert _refusal(tmp_path, {"zero_optimization": {"stage": 1, "shard_everything": True}}) == (
        f'unknown key "zero_optimization.shard_everything": DeepSpeed {deepspeed.__version__} reads no such key '
        'in "zero_optimization" (https://www.deepspeed.ai/docs/config-json/); remove it'
    )


@pytest.mark.parametrize(
    "config, message",
    [
        ({"gradient_clipping": "1.0"}, '"gradient_clipping" is "1.0"; it must be a number'),
        ({"wall_clock_breakdown": 1}, '"wall_clock_breakdown" is 1; it must be true or false'),
        ({"steps_per_print": 10.5}, '"steps_per_print" is 10.5; it must be an integer or null'),
        (
            {"zero_optimization": {"reduce_bucket_size": "5e8"}},
            f'"zero_optimization.reduce_bucket_size" is "5e8"; DeepSpeed {deepspeed.__version__} refuses it: '
            "Input should be a valid integer, unable to parse string as an integer",
        ),
        ({"pipeline": {"pipe_partitioned": "no"}}, '"pipeline.pipe_partitioned" is "no"; it must be true or false'),
    ],
)
def test_a_value_of_the_wrong_type_is_one_line_naming_path_value_and_type(tmp_path, config, message):
    assert _refusal(tmp_path, config) == message


def test_deepspeeds_aliases_and_the_values_its_models_accept_pass(tmp_path):
    path = tmp_path / "ds.json"
    zero = {
        "stage": 3,
        "stage3_max_live_parameters": 1e9,
        "stage3_prefetch_bucket_size": 5e7,
        "max_reuse_distance": 1000,
        "reduce_bucket_size": 5e8,
        "offload_param": {"device": "none"},
    }
    config = {**BATCH, "zero_optimization": zero, "steps_per_print": None, "timers": {"throughput": {"enabled": True}}}
    path.write_text(json.dumps(config))
    assert read_deepspeed_config(str(path)) == config


def test_deepspeeds_old_bf16_name_is_refused_with_the_new_one(tmp_path):
    assert _refusal(tmp_path, {"bfloat16": {"enabled": True}}) == (
        '"bfloat16" is DeepSpeed\'s old name of "bf16"; rename it "bf16"'
    )


def _prepare(tmp_path, ds: dict):
    ds_path = tmp_path / "ds.json"
    ds_path.write_text(json.dumps({**BATCH, **ds}))
    script = load_train_script()
    args = script.parse_args(
        ["--deepspeed_config", str(ds_path), "--model-config", str(TINY_MODEL), "--train-iters", "10"]
    )
    return script.prepare(args, 1)


@pytest.mark.parametrize(
    "ds, words",
    [
        ({"optimizer": {"type": "AdamW", "params": {"lrr": 1e-3}}}, "optimizer.params ['lrr']: not translated"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 5}}}, "scheduler.params ['warmup_steps']"),
        ({"bf16": {"enabled": True, "enabeld": True}}, 'only "enabled": true/false is translated'),
        ({"pipeline": {"activation_checkpoint_interval": "2"}}, "use --checkpoint-activations-interval 2"),
    ],
)
def test_the_blocks_we_translate_keep_their_own_messages(tmp_path, ds, words):
    with pytest.raises(LayoutError, match=re.escape(words)):
        _prepare(tmp_path, ds)


def test_train_py_refuses_a_misspelt_key_in_one_line_with_exit_2_leaving_the_file_as_it_was(
    tmp_path, capsys, monkeypatch
):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BATCH, "zero_optimisation": {"stage": 1}}))
    before = path.read_bytes()
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--deepspeed_config", str(path), "--model-config", str(TINY_MODEL), "--train-iters", "3"]
    with pytest.raises(SystemExit) as exit_info:
        load_train_script().main(argv)
    assert exit_info.value.code == 2 and not dist.is_initialized()
    assert capsys.readouterr().err.splitlines() == [
        f'train.py: error: --deepspeed_config {str(path)!r}: unknown key "zero_optimisation"; '
        'did you mean "zero_optimization"?'
    ]
    assert path.read_bytes() == before


class _Reads(dict):
    """A dict that notes each key DeepSpeed looks up in it; its copy (DeepSpeedConfig reads a copy) notes its own."""

    copies: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: set = set()

    def __copy__(self):
        copy = _Reads(self)
        _Reads.copies.append(copy)
        return copy

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def keys(self):
        return _Keys(self)


class _Keys:
    def __init__(self, reads: _Reads):
        self.reads = reads

    def __contains__(self, key):
        return key in self.reads

    def __iter__(self):
        return iter(dict.keys(self.reads))


def moved(what: str) -> str:
    return (
        f"DeepSpeed {deepspeed.__version__}: {what} differ from pipelines/config/ds_keys.py's tables "
        "(written against DeepSpeed 0.19.8); update the tables from DeepSpeed's source"
    )


def test_the_tables_hold_exactly_the_keys_deepspeed_reads():
    blocks = {
        "activation_checkpointing": ds_keys.ACTIVATION_CHECKPOINTING,
        "flops_profiler": ds_keys.FLOPS_PROFILER,
        "torch_autocast": ds_keys.TORCH_AUTOCAST,
        "data_types": ds_keys.DATA_TYPES,
        "aio": ds_keys.AIO,
        "timers": ds_keys.TOP_LEVEL["timers"],
        "optimizer": ds_keys.TOP_LEVEL["optimizer"],
        "scheduler": ds_keys.TOP_LEVEL["scheduler"],
    }
    read = {name: _Reads() for name in blocks}
    read["optimizer"] = _Reads(type="Adam")  # its params are read only for a named optimizer
    read["scheduler"] = _Reads(type="WarmupLR")
    writer, parallel_write = _Reads(), _Reads()
    checkpoint = _Reads(writer=writer, parallel_write=parallel_write)
    config = _Reads({**BATCH, **read, "checkpoint": checkpoint})
    _Reads.copies.clear()
    DeepSpeedConfig(config)
    (top,) = _Reads.copies
    in_initialize = {"sequence_parallel_size", "data_parallel_size"}  # read by deepspeed.initialize
    assert all(f'"{key}"' in inspect.getsource(deepspeed.initialize) for key in in_initialize), moved("initialize")
    assert "vocabulary_size" in config.seen, moved("the keys DeepSpeedConfig checks")
    expected = set(ds_keys.TOP_LEVEL) - in_initialize - {"vocabulary_size"} | set(ds_keys.RENAMED)
    assert top.seen == expected, moved("the top-level keys")
    for name, table in blocks.items():
        assert read[name].seen == set(table), moved(f'the keys of "{name}"')
    assert checkpoint.seen == set(ds_keys.CHECKPOINT), moved('the keys of "checkpoint"')
    assert writer.seen == set(ds_keys.CHECKPOINT["writer"]), moved('the keys of "checkpoint.writer"')
    assert parallel_write.seen == set(ds_keys.CHECKPOINT["parallel_write"]), moved("checkpoint.parallel_write")
    pipeline_engine = inspect.getsource(deepspeed.runtime.pipe.engine.PipelineEngine.__init__)
    assert "pipeline.get('use_reentrant')" in pipeline_engine, moved("the keys of pipeline")
    assert set(get_pipeline_config({})) | {"use_reentrant"} == set(ds_keys.PIPELINE), moved("the keys of pipeline")


def test_deepspeeds_models_refuse_keys_they_do_not_take():
    models = [spec for spec in ds_keys.TOP_LEVEL.values() if isinstance(spec, type)]
    models.append(ds_keys.TOP_LEVEL["timers"]["throughput"])
    assert all(model.model_config["extra"] == "forbid" for model in models), moved("the models' extra setting")
