"""A hybrid run's start-up: the summary counts its layer kinds; --hybrid-layer-pattern (Megatron's older
name: --hybrid-override-pattern) sets the pattern; a pattern or layout the model cannot take is one line
on stderr, exit status 2, before any process group exists."""

import json

import pytest
import torch.distributed as dist

from megamamba.config import MambaConfig
from megamamba.data.training_data import training_data
from megamamba.model.lm import MambaLM
from megamamba.observe.run_console import count_parameters, startup_summary
from megamamba.pipelines.config.layout import Layout
from megamamba.schedule.lr_schedule import LRSchedule
from train_entry import ROOT, load_train_script

TINY_HYBRID = json.loads((ROOT / "launch/models/tiny-hybrid.json").read_text())
WITHOUT_PATTERN = {k: v for k, v in TINY_HYBRID.items() if k != "hybrid_layer_pattern"}


def _argv(tmp_path, model, flags=()):
    model_path = tmp_path / "model.json"
    model_path.write_text(json.dumps(model))
    return [
        "--deepspeed_config",
        str(ROOT / "launch/configs/tiny-cpu.json"),
        "--model-config",
        str(model_path),
        "--train-iters",
        "3",
        "--seq-length",
        "32",
        *flags,
    ]


def _plan(tmp_path, model, flags=(), world=1):
    script = load_train_script()
    return script.prepare(script.parse_args(_argv(tmp_path, model, flags)), world)


def _refusal(tmp_path, capsys, monkeypatch, model, flags=(), world=1) -> str:
    """The one line main() prints when it refuses the run; it must exit 2 and start nothing."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exit_info:
        load_train_script().main(_argv(tmp_path, model, flags))
    assert exit_info.value.code == 2 and not dist.is_initialized()
    (line,) = capsys.readouterr().err.splitlines()
    return line


@pytest.mark.parametrize("flag", ["--hybrid-layer-pattern", "--hybrid-override-pattern"])
def test_the_pattern_flag_sets_the_model_configs_hybrid_layer_pattern(tmp_path, flag):
    plan = _plan(tmp_path, WITHOUT_PATTERN, [flag, "M*-M-"])
    assert plan.model.hybrid_layer_pattern == "M*-M-"
    assert plan.model.block_kinds == ["mamba", "attention", "mlp", "mamba", "mlp"]


def test_the_flag_repeating_the_files_pattern_changes_nothing(tmp_path):
    assert (
        _plan(tmp_path, TINY_HYBRID, ["--hybrid-layer-pattern", TINY_HYBRID["hybrid_layer_pattern"]]).model
        == _plan(tmp_path, TINY_HYBRID).model
    )


def test_a_pattern_of_another_length_than_n_layer_is_one_line_naming_both_and_the_fix(tmp_path, capsys, monkeypatch):
    line = _refusal(tmp_path, capsys, monkeypatch, WITHOUT_PATTERN, ["--hybrid-layer-pattern", "M*-M"])
    assert line.startswith("train.py: error: --hybrid-layer-pattern 'M*-M' with --model-config ")
    assert "has 4 layers but n_layer=5: set n_layer to 4" in line


def test_an_unknown_pattern_symbol_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    line = _refusal(tmp_path, capsys, monkeypatch, WITHOUT_PATTERN, ["--hybrid-override-pattern", "M*-MX"])
    assert "unknown symbol(s) ['X']; use M (mamba), * (attention), - (mlp)" in line  # and any kind registered since
    assert line.endswith("and | (a pipeline-stage boundary)"), line


def test_a_flag_disagreeing_with_the_files_pattern_is_refused_naming_both(tmp_path, capsys, monkeypatch):
    line = _refusal(tmp_path, capsys, monkeypatch, TINY_HYBRID, ["--hybrid-layer-pattern", "M*-M-"])
    assert line.endswith(
        "--hybrid-layer-pattern 'M*-M-' disagrees with --model-config "
        f"'{tmp_path / 'model.json'}''s hybrid_layer_pattern='M-M*-'; keep one"
    )


@pytest.mark.parametrize(
    "attention, tp, words",
    [
        (
            {},
            8,
            "attention tensor parallelism splits the query heads across ranks: num_heads = 4 is not divisible by "
            "TP = 8",
        ),
        ({"num_heads": 6, "num_heads_kv": 3}, 2, "num_heads_kv = 3 does neither at TP = 2"),
    ],
)
def test_a_layout_that_cannot_split_the_attention_heads_is_one_line(
    tmp_path, capsys, monkeypatch, attention, tp, words
):
    model = {**TINY_HYBRID, "attn_cfg": {**TINY_HYBRID["attn_cfg"], **attention}}
    line = _refusal(tmp_path, capsys, monkeypatch, model, ["--tp", str(tp)], world=tp)
    assert line.startswith("train.py: error: ") and words in line


def test_the_start_up_summary_counts_a_hybrids_layer_kinds_and_parameters():
    config = MambaConfig.from_dict(TINY_HYBRID)
    total = sum(p.numel() for p in MambaLM(config).parameters())
    lines = startup_summary(
        model=config,
        layout=Layout(world_size=1, dp=1, tp=1, pp=1, micro_batch_size=2, grad_accum=4),
        seq_length=32,
        train_iters=3,
        schedule=LRSchedule(1e-3, 1e-4, 0, 3, "cosine"),
        engine_config={},
        data=training_data(config, "bytes", [], [], 32, 8, 1234),
        total_params=count_parameters(config),
        stage_params=(1, 1),
        save=None,
        load=None,
        save_interval=0,
        keep_last=None,
    )
    assert lines[0].startswith(
        f"run: Mamba2, 5 layers (2 Mamba2, 1 attention, 2 MLP), d_model 64 | parameters {total} "
    )
    assert lines[-1] == (  # before training: what it exports to, and every setting that keeps it from a format
        "  exports to: none (mamba_ssm: MLP layers (-) | transformers NemotronH: attn_cfg qkv_proj_bias=True, "
        "out_proj_bias=True; attn_cfg.rotary_emb_dim=8; mlp_activation='gated_silu')"
    )


def test_the_quick_starts_hybrid_model_takes_the_readmes_pattern(tmp_path):
    """scripts/quickstart.sh with QUICKSTART_PATTERN="M*M-": launch/models/quickstart-hybrid.json holds the layers'
    options, the flag places them."""
    model = json.loads((ROOT / "launch/models/quickstart-hybrid.json").read_text())
    plan = _plan(tmp_path, model, ["--hybrid-layer-pattern", "M*M-"], world=2)
    assert plan.model.block_kinds == ["mamba", "attention", "mamba", "mlp"]
