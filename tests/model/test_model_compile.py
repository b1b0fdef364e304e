"""torch.compile sees whole blocks: a Mamba-1, a Mamba-2 and an attention block with its MLP trace with no
graph break (the kernels are custom ops), and the compiled block's outputs and every gradient equal eager
ones, with packed documents. On the reference kernels here; on Triton (the CPU: its interpreter) and with
inductor in the slow tier, where five training steps of a whole compiled model also follow the eager loss
curve."""

import pytest
import torch

from megamamba import MambaConfig, MambaLM
from megamamba.model.layers import build_layer
from megamamba.model.stream import Stream
from megamamba.testing.numerics import relative_error
from train_entry import ROOT

SEED = 37
ATTENTION = {"num_heads": 3, "num_heads_kv": 1, "rotary_emb_dim": 4, "causal": True}
CONFIGS = {  # (config, layer index of the block)
    "mamba1": (
        MambaConfig(d_model=18, n_layer=2, vocab_size=37, ssm_cfg={"layer": "Mamba1", "d_state": 5, "dt_rank": 3}),
        1,
    ),
    "mamba2": (
        MambaConfig(
            d_model=18,
            n_layer=2,
            vocab_size=37,
            ssm_cfg={"layer": "Mamba2", "d_state": 6, "headdim": 6, "ngroups": 2, "chunk_size": 8},
        ),
        1,
    ),
    "attention_mlp": (
        MambaConfig(d_model=18, n_layer=2, vocab_size=37, attn_layer_idx=[1], attn_cfg=ATTENTION, d_intermediate=20),
        2,
    ),
}


def block_and_stream(kind):
    """The block, and its input stream (batch 2, 11 positions: two documents in row 0) with its ids."""
    config, index = CONFIGS[kind]
    block = build_layer(config, index, SEED)
    stream = torch.randn(2, 11, config.d_model, generator=torch.Generator().manual_seed(SEED))
    seq_idx = torch.zeros(2, 11, dtype=torch.int32)
    seq_idx[0, 5:] = 1
    return block, stream, seq_idx


def graph_breaks(kind):
    block, stream, seq_idx = block_and_stream(kind)
    return torch._dynamo.explain(block)(Stream(stream, seq_idx)).graph_break_count


def outputs_and_gradients(block, run, stream, seq_idx):
    """The block's output, and the gradients of the stream and of every parameter, under a seeded output
    gradient."""
    block.zero_grad()
    x = stream.clone().requires_grad_()
    out = run(Stream(x, seq_idx)).hidden
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(SEED + 1))
    (out * g).sum().backward()
    return {"out": out.detach(), "stream": x.grad, **{n: p.grad.clone() for n, p in block.named_parameters()}}


def check_compiled_equals_eager(kind, backend):
    torch._dynamo.reset()
    block, stream, seq_idx = block_and_stream(kind)
    eager = outputs_and_gradients(block, block, stream, seq_idx)
    compiled = outputs_and_gradients(block, torch.compile(block, backend=backend, fullgraph=True), stream, seq_idx)
    for name, value in eager.items():
        err = relative_error(compiled[name], value)
        assert err <= 1e-5, f"{kind} {backend} seed {SEED}: {name} rel err {err:.2e}"


@pytest.mark.parametrize("kind", CONFIGS)
def test_a_block_traces_without_graph_breaks(kind):
    assert graph_breaks(kind) == 0


@pytest.mark.parametrize("kind", CONFIGS)
def test_a_compiled_block_equals_eager(kind):
    check_compiled_equals_eager(kind, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("kind", CONFIGS)
def test_a_block_compiled_by_inductor_equals_eager(kind):
    check_compiled_equals_eager(kind, "inductor")


@pytest.mark.slow
@pytest.mark.parametrize("kind", CONFIGS)
def test_on_triton_a_block_traces_without_breaks_and_compiled_equals_eager(kind, monkeypatch):
    """The Triton kernels stay behind their ops: dynamo never reaches the launchers (or the interpreter)."""
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    assert graph_breaks(kind) == 0
    check_compiled_equals_eager(kind, "aot_eager")


def _training_curve(config: MambaConfig, compiled: bool) -> torch.Tensor:
    """Five AdamW steps of the model's own training loss on seeded batches (4 x 32 tokens)."""
    torch._dynamo.reset()
    torch.manual_seed(SEED)
    model = MambaLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = torch.compile(model, backend="inductor") if compiled else model
    batches = torch.Generator().manual_seed(SEED + 2)
    losses = []
    for _ in range(5):
        ids = torch.randint(0, config.vocab_size, (4, 33), generator=batches)
        loss = run(ids[:, :-1], ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses).double()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-mamba1", "tiny-mamba2", "tiny-hybrid"])
def test_five_training_steps_compiled_by_inductor_follow_the_eager_loss_curve(name):
    config = MambaConfig.from_json(str(ROOT / "launch/models" / f"{name}.json"))
    eager, compiled = _training_curve(config, compiled=False), _training_curve(config, compiled=True)
    err = relative_error(compiled, eager)
    assert err <= 1e-5, f"{name} seed {SEED}: loss curve rel err {err:.2e} ({compiled.tolist()} vs {eager.tolist()})"
