"""A kind of layer described once: a toy block defined and registered in this module alone is trained by
launch/train.py, counted in its MFU, saved in its checkpoint, planned by the planner and estimated by the
memory plan, with no edit anywhere else (each reads the layer through its `LayerType`)."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_ranks
from megamamba.checkpoint.model_folder import load_model_folder
from megamamba.config import ConfigError, MambaConfig
from megamamba.errors import LayoutError
from megamamba.model.block import Block
from megamamba.model.flops import training_flops_per_token
from megamamba.model.layer_types import BlockType, register
from megamamba.model.layer_types.costs import STREAM, Kernel, LayerWork, RankShape, matmul, norm
from megamamba.model.layers import build_layer, layer_kinds
from megamamba.model.stream import Stream
from megamamba.pipelines.memory.activations import kept_bytes
from megamamba.pipelines.planner.profile import load_profile
from megamamba.pipelines.planner.search import Request, search
from resume_runs import COMMON
from saved_tensors import autograd_saved_bytes
from train_entry import ROOT, run_train

SEQ = int(COMMON[COMMON.index("--seq-length") + 1])


class GatedScale(nn.Module):
    """y = out(silu(x) * scale): a mixer no other module knows."""

    def __init__(self, d_model: int, device=None, dtype=None):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))
        self.output_projection = nn.Linear(d_model, d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x, seq_idx=None, inference_state=None):
        return self.output_projection(F.silu(x) * self.scale)


class GatedScaleBlock(Block):
    def __init__(self, config: MambaConfig, tp=None, cp=None, device=None, dtype=None):
        super().__init__(config, lambda: GatedScale(config.d_model, device, dtype), tp, device, dtype)


class GatedScaleType(BlockType):
    """Kept per token: the normed input, silu's output and the product (float32 runs only)."""

    kind, symbol, block_class = "gated_scale", "G", GatedScaleBlock

    def check_mixer_layout(self, config: MambaConfig, tp_size: int) -> None:
        if tp_size > 1:
            raise LayoutError(f"the gated-scale toy layer is not tensor-parallel: TP = {tp_size}")

    def mixer_flops(self, config: MambaConfig, seq_length: int) -> int:
        return 2 * config.d_model * config.d_model

    def mixer_kept_bytes(self, shape: RankShape) -> int:
        return 3 * shape.act * shape.model.d_model * shape.tokens

    def mixer_weight_elements(self, shape: RankShape) -> int:
        return shape.model.d_model**2

    def mixer_work(self, shape: RankShape) -> LayerWork:
        d = shape.model.d_model
        silu = Kernel("elementwise", 0, 3 * shape.act * shape.tokens * d)
        return LayerWork((norm(shape), silu, matmul(shape, d, d)))


register(GatedScaleType())


def _model_fields() -> dict:
    tiny = json.loads((ROOT / "launch/models/tiny-mamba2.json").read_text())
    return {**tiny, "n_layer": 3, "hybrid_layer_pattern": "MGM"}


def train_and_save(argv: list, extensions_dir: str) -> dict:
    """train.py's main on this spawned rank, which imported this module and so knows the toy layer."""
    return run_train(argv, extensions_dir)


@pytest.fixture(scope="module")
def toy_run(resume_runs):
    """A short run of the toy hybrid on one rank, saved at the end."""
    out = resume_runs.new_dir()
    argv = [
        "--deepspeed_config",
        resume_runs.ds_config(zero=0),
        "--model-config",
        resume_runs.model_config(**_model_fields()),
        "--metrics-jsonl",
        str(out / "metrics.jsonl"),
        *COMMON,
        "--save",
        str(out / "ckpt"),
    ]
    (summary,) = run_ranks(train_and_save, 1, args=(argv, resume_runs.extensions_dir), init_process_group=False)
    return summary, out


@pytest.mark.slow
def test_a_registered_toy_layer_trains_and_counts_in_mfu(toy_run):
    summary, _ = toy_run
    config = MambaConfig.from_dict(_model_fields())
    losses = [r["loss"] for r in summary["records"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    record = summary["records"][-1]
    counted = record["tflops_per_device"] * 1e12 / record["tokens_per_s"]
    assert counted == pytest.approx(training_flops_per_token(config, SEQ), rel=1e-9)
    assert (
        training_flops_per_token(config, SEQ)
        - training_flops_per_token(
            MambaConfig.from_dict({**_model_fields(), "n_layer": 2, "hybrid_layer_pattern": "MM"}), SEQ
        )
        == 3 * 2 * config.d_model**2
    )


@pytest.mark.slow
def test_a_registered_toy_layer_is_saved_and_loads_back_trained(toy_run):
    _, out = toy_run
    model = load_model_folder(str(sorted((out / "ckpt").glob("step_*"))[-1]))
    state = model.state_dict()
    assert isinstance(model.backbone.layers[1].mixer, GatedScale)
    assert state["backbone.layers.1.mixer.output_projection.weight"].shape == (64, 64)
    assert not torch.equal(state["backbone.layers.1.mixer.scale"], torch.ones(64))


def test_the_planner_plans_a_model_with_a_registered_toy_layer():
    config = MambaConfig.from_dict(_model_fields())
    request = Request(config, gpus=2, gpus_per_node=2, seq_length=SEQ, global_batch_size=8, device_memory=2**33)
    found = search(request, load_profile(str(ROOT / "launch/profiles/h100-80gb.json")))
    assert found.plans and all(plan.tp == 1 for plan in found.plans)  # the toy layer refuses TP
    assert any("gated-scale toy layer" in rejection.reason for rejection in found.rejected)


def test_the_memory_plan_estimates_what_autograd_keeps_in_a_registered_toy_layer(monkeypatch):
    """A stage holding the toy block alone keeps what autograd keeps in it (on the Triton kernels, interpreted),
    and its output until the next stage returns the gradient."""
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    config = MambaConfig.from_dict(_model_fields())
    index = layer_kinds(config).index("gated_scale")
    block = build_layer(config, index, seed=0)
    stream = torch.randn(2, SEQ, config.d_model, requires_grad=True)
    measured = autograd_saved_bytes(block, lambda: block(Stream(stream)))
    shape = RankShape(config, 2, SEQ, act=4)
    output = STREAM * config.d_model * shape.tokens
    estimated = kept_bytes(shape, index, index + 1, len(layer_kinds(config)) - 1)
    assert estimated == measured + output, (measured, estimated)


def test_a_kind_cannot_take_a_pattern_symbol_in_use():
    taken = type("Again", (GatedScaleType,), {"kind": "again", "symbol": "M"})
    with pytest.raises(ConfigError, match="symbol 'M'"):
        register(taken())
