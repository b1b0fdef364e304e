"""Parallel layers at TP 2 and 4, with and without sequence parallelism, against float64 torch.

Every rank loads the same full float64-drawn weights (cast to float32) into the parallel layer;
outputs and gradients, gathered to full shapes, are compared with nn.functional in float64 on
the full tensors. Each layer's forward and backward collectives are captured and compared with
the design. One spawned run per TP size computes everything; the tests read its results.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_ranks
from megamamba.parallel import (
    ColumnParallelLinear,
    CommRecord,
    Component,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
    comm_counter,
    full_tensors,
    load_full_tensors,
    tp_padded_vocab_size,
    vocab_parallel_cross_entropy,
)
from megamamba.testing.numerics import relative_error

pytestmark = pytest.mark.slow

SEED = 1234
BATCH, SEQLEN = 3, 8
F32 = 4  # bytes


def _gather(t, tp, dim):
    parts = [torch.empty_like(t) for _ in range(tp.size)]
    dist.all_gather(parts, t.detach().contiguous(), group=tp.group)
    return torch.cat(parts, dim)


def _seq_local(full, tp):
    return full.chunk(tp.size, 1)[tp.rank] if tp.sequence_parallel else full


def _seq_full(local, tp):
    return _gather(local, tp, 1) if tp.sequence_parallel else local


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _run(layer, x_in, upstream):
    """Forward, then backward of <output, upstream>; the collectives of each phase."""
    with comm_counter.capture() as fwd:
        out = layer(x_in)
    with comm_counter.capture() as bwd:
        (out * upstream.to(out.dtype)).sum().backward()
    return out, fwd, bwd


def _features(local, tp, comps):
    """Full features of a column-parallel output (component order), independently of the library."""
    sizes = [c.size // tp.size if c.sharded else c.size for c in comps]
    return torch.cat([_gather(p, tp, -1) if c.sharded else p for c, p in zip(comps, local.split(sizes, -1))], -1)


def _local_features(full, tp, comps, replicated_upstream=None):
    """This rank's features of a full tensor, replicated components taken from `replicated_upstream`."""
    blocks = full.split([c.size for c in comps], -1)
    rep = (
        iter(replicated_upstream.split([c.size for c in comps if not c.sharded], -1))
        if replicated_upstream is not None
        else None
    )
    return torch.cat([b.chunk(tp.size, -1)[tp.rank] if c.sharded else next(rep) for c, b in zip(comps, blocks)], -1)


def check_column(tp, comps, gather_output=False):
    """ColumnParallelLinear(7, sum(comps)); replicated components get a different upstream per rank."""
    gen = torch.Generator().manual_seed(SEED)
    n_in, n_out = 7, sum(c.size for c in comps)
    w, b = _randn(gen, n_out, n_in), _randn(gen, n_out)
    x, up = _randn(gen, BATCH, SEQLEN, n_in), _randn(gen, BATCH, SEQLEN, n_out)
    rep_cols = sum(c.size for c in comps if not c.sharded)
    rep_up = [_randn(gen, BATCH, SEQLEN, rep_cols) for _ in range(tp.size)]

    # reference: the replicated outputs' upstream gradient is the sum of every rank's use
    ref_up = up.clone()
    if rep_cols:
        starts = torch.tensor([0] + [c.size for c in comps]).cumsum(0)
        rep_index = torch.cat([torch.arange(starts[i], starts[i + 1]) for i, c in enumerate(comps) if not c.sharded])
        ref_up[..., rep_index] = sum(rep_up)
    wr, br, xr = _leaf(w), _leaf(b), _leaf(x)
    ref = F.linear(xr, wr, br)
    (ref * ref_up).sum().backward()

    layer = ColumnParallelLinear(n_in, n_out, tp, components=comps, gather_output=gather_output)
    load_full_tensors(layer, {"weight": w.float(), "bias": b.float()}, tp)
    x_in = _leaf(_seq_local(x, tp).float())
    local_up = up if gather_output else _local_features(up, tp, comps, rep_up[tp.rank] if rep_cols else None)
    out, fwd, bwd = _run(layer, x_in, local_up)
    full_out = out if gather_output else _features(out, tp, comps)
    grads = full_tensors(layer, tp, lambda p: p.grad)
    return dict(
        out=relative_error(full_out, ref),
        x_grad=relative_error(x_in.grad, _seq_local(xr.grad, tp)),
        weight_grad=relative_error(grads["weight"], wr.grad),
        bias_grad=relative_error(grads["bias"], br.grad),
        weight_exact=torch.equal(full_tensors(layer, tp)["weight"], w.float()),
        fwd=fwd,
        bwd=bwd,
        numel_in=x.numel(),
        numel_out=BATCH * SEQLEN * n_out,
    )


def check_row(tp):
    gen = torch.Generator().manual_seed(SEED + 1)
    n_in, n_out = 12, 5
    w, b = _randn(gen, n_out, n_in), _randn(gen, n_out)
    x, up = _randn(gen, BATCH, SEQLEN, n_in), _randn(gen, BATCH, SEQLEN, n_out)
    wr, br, xr = _leaf(w), _leaf(b), _leaf(x)
    ref = F.linear(xr, wr, br)
    (ref * up).sum().backward()

    layer = RowParallelLinear(n_in, n_out, tp)
    load_full_tensors(layer, {"weight": w.float(), "bias": b.float()}, tp)
    x_in = _leaf(x.chunk(tp.size, -1)[tp.rank].float())
    out, fwd, bwd = _run(layer, x_in, _seq_local(up, tp))
    grads = full_tensors(layer, tp, lambda p: p.grad)
    return dict(
        out=relative_error(_seq_full(out, tp), ref),
        x_grad=relative_error(x_in.grad, xr.grad.chunk(tp.size, -1)[tp.rank]),
        weight_grad=relative_error(grads["weight"], wr.grad),
        bias_grad=relative_error(grads["bias"], br.grad),
        weight_exact=torch.equal(full_tensors(layer, tp)["weight"], w.float()),
        fwd=fwd,
        bwd=bwd,
        numel_out=ref.numel(),
    )


def check_embedding(tp):
    gen = torch.Generator().manual_seed(SEED + 2)
    vocab, dim = 13, 6
    w, up = _randn(gen, vocab, dim), _randn(gen, BATCH, SEQLEN, dim)
    ids = torch.randint(0, vocab, (BATCH, SEQLEN), generator=gen)
    wr = _leaf(w)
    ref = F.embedding(ids, wr)
    (ref * up).sum().backward()

    layer = VocabParallelEmbedding(vocab, dim, tp)
    load_full_tensors(layer, {"weight": w.float()}, tp)
    out, fwd, bwd = _run(layer, ids, _seq_local(up, tp))
    return dict(
        out=relative_error(_seq_full(out, tp), ref),
        weight_grad=relative_error(full_tensors(layer, tp, lambda p: p.grad)["weight"], wr.grad),
        weight_exact=torch.equal(full_tensors(layer, tp)["weight"], w.float()),
        local_rows=layer.weight.shape[0],
        fwd=fwd,
        bwd=bwd,
        numel_out=ref.numel(),
    )


def check_head_loss(tp):
    """VocabParallelHead + vocab_parallel_cross_entropy (mean, ignore_index) vs F.cross_entropy."""
    gen = torch.Generator().manual_seed(SEED + 3)
    vocab, dim = 11, 7
    w, h = _randn(gen, vocab, dim), _randn(gen, BATCH, SEQLEN, dim)
    target = torch.randint(0, vocab, (BATCH, SEQLEN), generator=gen)
    target[0, :3] = -100
    wr, hr = _leaf(w), _leaf(h)
    ref = F.cross_entropy(F.linear(hr, wr).flatten(0, 1), target.flatten(), ignore_index=-100)
    ref.backward()

    head = VocabParallelHead(dim, vocab, tp)
    load_full_tensors(head, {"weight": w.float()}, tp)
    h_in = _leaf(_seq_local(h, tp).float())
    with comm_counter.capture() as fwd:
        loss = vocab_parallel_cross_entropy(head(h_in), target, tp, vocab_size=vocab)
    with comm_counter.capture() as bwd:
        loss.backward()
    return dict(
        loss=relative_error(loss, ref),
        h_grad=relative_error(h_in.grad, _seq_local(hr.grad, tp)),
        weight_grad=relative_error(full_tensors(head, tp, lambda p: p.grad)["weight"], wr.grad),
        fwd=fwd,
        bwd=bwd,
        tokens=target.numel(),
        numel_h=h.numel(),
    )


def check_cross_entropy(tp):
    """vocab_parallel_cross_entropy on given logits, padding columns holding large values."""
    gen = torch.Generator().manual_seed(SEED + 4)
    vocab = 11
    padded = tp_padded_vocab_size(vocab, tp.size) + tp.size  # at least one padding row
    logits = _randn(gen, BATCH, SEQLEN, vocab)
    target = torch.randint(0, vocab, (BATCH, SEQLEN), generator=gen)
    target[1, 2:5] = -100
    lr = _leaf(logits)
    ref = F.cross_entropy(lr.flatten(0, 1), target.flatten(), ignore_index=-100, reduction="none").view(BATCH, SEQLEN)
    ref.sum().backward()

    padding = torch.full((BATCH, SEQLEN, padded - vocab), 50.0, dtype=torch.float64)
    local = _leaf(torch.cat([logits, padding], -1).chunk(tp.size, -1)[tp.rank].float())
    loss = vocab_parallel_cross_entropy(local, target, tp, vocab_size=vocab, reduction="none")
    loss.sum().backward()
    grad = _gather(local.grad, tp, -1)
    return dict(
        loss=relative_error(loss, ref),
        logits_grad=relative_error(grad[..., :vocab], lr.grad),
        padding_grad_zero=bool((grad[..., vocab:] == 0).all()),
        ignored_loss_zero=bool((loss[1, 2:5] == 0).all()),
    )


def check_init(tp):
    """Full weights each layer draws after manual_seed(s) vs the matching torch module's."""
    pairs = {
        "column_fused": (
            lambda: ColumnParallelLinear(7, 30, tp, components=IN_PROJ_REPLICATED),
            lambda: torch.nn.Linear(7, 30),
        ),
        "row": (lambda: RowParallelLinear(12, 5, tp), lambda: torch.nn.Linear(12, 5)),
        "embedding": (lambda: VocabParallelEmbedding(13, 6, tp), lambda: torch.nn.Embedding(13, 6)),
        "head": (lambda: VocabParallelHead(6, 13, tp), lambda: torch.nn.Linear(6, 13, bias=False)),
    }
    same = {}
    for name, (ours, theirs) in pairs.items():
        torch.manual_seed(SEED + 5)
        full = full_tensors(ours(), tp)
        torch.manual_seed(SEED + 5)
        ref = theirs().state_dict()
        same[name] = full.keys() == ref.keys() and all(torch.equal(full[k], ref[k]) for k in ref)
    return same


IN_PROJ_REPLICATED = (
    Component("z", 8),
    Component("x", 12),
    Component("B", 3, sharded=False),
    Component("C", 3, sharded=False),
    Component("dt", 4),
)
IN_PROJ_SHARDED = (Component("z", 8), Component("x", 12), Component("B", 4), Component("C", 4), Component("dt", 4))


def layer_checks():
    """Everything measured on one rank, keyed by (check, sequence_parallel)."""
    torch.manual_seed(0)
    size = dist.get_world_size()
    results = {}
    for sp in (False, True):
        tp = TensorParallel(dist.group.WORLD, size, dist.get_rank(), sequence_parallel=sp)
        results["column", sp] = check_column(tp, (Component("out_features", 12),))
        results["column_gather", sp] = check_column(tp, (Component("out_features", 12),), gather_output=True)
        results["fused_gather", sp] = check_column(tp, IN_PROJ_SHARDED, gather_output=True)
        results["fused_sharded", sp] = check_column(tp, IN_PROJ_SHARDED)
        results["fused_replicated", sp] = check_column(tp, IN_PROJ_REPLICATED)
        results["row", sp] = check_row(tp)
        results["embedding", sp] = check_embedding(tp)
        results["head_loss", sp] = check_head_loss(tp)
        results["cross_entropy", sp] = check_cross_entropy(tp)
        results["init", sp] = check_init(tp)
    return results


@functools.cache
def _results(tp_size):
    return run_ranks(layer_checks, tp_size, timeout=300)


TOL = 1e-5
CASES = [(tp, sp) for tp in (2, 4) for sp in (False, True)]
IDS = [f"tp{tp}-{'sp' if sp else 'nosp'}" for tp, sp in CASES]


def _per_rank(tp_size, check, sp):
    return [r[check, sp] for r in _results(tp_size)]


def _assert_close(tp_size, check, sp, keys):
    for rank, res in enumerate(_per_rank(tp_size, check, sp)):
        for key in keys:
            assert res[key] <= TOL, f"{check} {key} rank {rank}: rel err {res[key]:.2e} > {TOL} (seed {SEED})"


@pytest.mark.parametrize("tp_size,sp", CASES, ids=IDS)
@pytest.mark.parametrize("check", ["column", "column_gather", "fused_gather", "fused_sharded", "fused_replicated"])
def test_column_parallel_output_and_gradients_match_full_linear(tp_size, sp, check):
    _assert_close(tp_size, check, sp, ["out", "x_grad", "weight_grad", "bias_grad"])


@pytest.mark.parametrize("tp_size,sp", CASES, ids=IDS)
@pytest.mark.parametrize("check", ["row", "embedding", "fused_sharded", "fused_replicated"])
def test_loading_then_gathering_a_full_weight_round_trips_exactly(tp_size, sp, check):
    assert all(res["weight_exact"] for res in _per_rank(tp_size, check, sp))


@pytest.mark.parametrize("tp_size,sp", CASES, ids=IDS)
def test_same_seed_draws_the_same_full_weights_as_torch_modules_at_any_tp(tp_size, sp):
    for rank, res in enumerate(_per_rank(tp_size, "init", sp)):
        assert all(res.values()), f"rank {rank}: {res}"


@pytest.mark.parametrize("tp_size,sp", CASES, ids=IDS)
def test_row_parallel_output_and_gradients_match_full_linear(tp_size, sp):
    _assert_close(tp_size, "row", sp, ["out", "x_grad", "weight_grad", "bias_grad"])


@pytest.mark.parametrize("tp_size,sp", CASES, ids=IDS)
def test_vocab_parallel_embedding_matches_full_embedding(tp_size, sp):
    _assert_close(tp_size, "embedding", sp, ["out", "weight_grad"])
    assert _per_rank(tp_size, "embedding", sp)[0]["local_rows"] == tp_padded_vocab_size(13, tp_size) // tp_size


@pytest.mark.parametrize("tp_size,sp", CASES, ids=IDS)
def test_vocab_parallel_head_and_loss_match_full_cross_entropy(tp_size, sp):
    _assert_close(tp_size, "head_loss", sp, ["loss", "h_grad", "weight_grad"])


@pytest.mark.parametrize("tp_size", [2, 4])
def test_vocab_parallel_cross_entropy_matches_torch_and_ignores_padding(tp_size):
    _assert_close(tp_size, "cross_entropy", False, ["loss", "logits_grad"])
    for res in _per_rank(tp_size, "cross_entropy", False):
        assert res["padding_grad_zero"] and res["ignored_loss_zero"]


def _sorted(records):
    return sorted(records, key=lambda r: (r.kind, r.nbytes, r.group_size))


def _records(*entries, tp_size):
    return _sorted(CommRecord(kind, nbytes, tp_size) for kind, nbytes in entries)


def _assert_comm(tp_size, check, sp, fwd, bwd):
    for rank, res in enumerate(_per_rank(tp_size, check, sp)):
        assert _sorted(res["fwd"]) == _records(*fwd, tp_size=tp_size), f"{check} forward, rank {rank}"
        assert _sorted(res["bwd"]) == _records(*bwd, tp_size=tp_size), f"{check} backward, rank {rank}"


@pytest.mark.parametrize("tp_size,sp", CASES, ids=IDS)
def test_column_parallel_communicates_input_gather_or_gradient_reduce(tp_size, sp):
    res = _per_rank(tp_size, "column", sp)[0]
    x_bytes = res["numel_in"] * F32
    if sp:
        _assert_comm(tp_size, "column", sp, [("all_gather", x_bytes)], [("reduce_scatter", x_bytes)])
    else:
        _assert_comm(tp_size, "column", sp, [], [("all_reduce", x_bytes)])


@pytest.mark.parametrize("tp_size,sp", CASES, ids=IDS)
def test_gather_output_adds_one_output_all_gather(tp_size, sp):
    res = _per_rank(tp_size, "column_gather", sp)[0]
    x_bytes, out_bytes = res["numel_in"] * F32, res["numel_out"] * F32
    if sp:
        _assert_comm(
            tp_size,
            "column_gather",
            sp,
            [("all_gather", x_bytes), ("all_gather", out_bytes)],
            [("reduce_scatter", x_bytes)],
        )
    else:
        _assert_comm(tp_size, "column_gather", sp, [("all_gather", out_bytes)], [("all_reduce", x_bytes)])


@pytest.mark.parametrize("tp_size,sp", CASES, ids=IDS)
def test_replicated_components_add_one_weight_and_one_bias_gradient_all_reduce(tp_size, sp):
    res = _per_rank(tp_size, "fused_replicated", sp)[0]
    x_bytes, rep_rows = res["numel_in"] * F32, 3 + 3
    grad_x = ("reduce_scatter", x_bytes) if sp else ("all_reduce", x_bytes)
    fwd = [("all_gather", x_bytes)] if sp else []
    _assert_comm(
        tp_size,
        "fused_replicated",
        sp,
        fwd,
        [grad_x, ("all_reduce", rep_rows * 7 * F32), ("all_reduce", rep_rows * F32)],
    )


@pytest.mark.parametrize("tp_size,sp", CASES, ids=IDS)
def test_row_parallel_communicates_one_reduction_forward(tp_size, sp):
    out_bytes = _per_rank(tp_size, "row", sp)[0]["numel_out"] * F32
    if sp:  # the bias sees only this rank's tokens: its gradient is summed
        _assert_comm(
            tp_size, "row", sp, [("reduce_scatter", out_bytes)], [("all_gather", out_bytes), ("all_reduce", 5 * F32)]
        )
    else:
        _assert_comm(tp_size, "row", sp, [("all_reduce", out_bytes)], [])


@pytest.mark.parametrize("tp_size,sp", CASES, ids=IDS)
def test_embedding_communicates_one_reduction_forward(tp_size, sp):
    out_bytes = _per_rank(tp_size, "embedding", sp)[0]["numel_out"] * F32
    if sp:
        _assert_comm(tp_size, "embedding", sp, [("reduce_scatter", out_bytes)], [("all_gather", out_bytes)])
    else:
        _assert_comm(tp_size, "embedding", sp, [("all_reduce", out_bytes)], [])


@pytest.mark.parametrize("tp_size,sp", CASES, ids=IDS)
def test_vocab_parallel_loss_reduces_two_scalars_per_token_and_never_gathers_logits(tp_size, sp):
    res = _per_rank(tp_size, "head_loss", sp)[0]
    tokens, h_bytes = res["tokens"], res["numel_h"] * F32
    loss_fwd = [("all_reduce_max", tokens * F32), ("all_reduce", 2 * tokens * F32)]
    if sp:
        _assert_comm(tp_size, "head_loss", sp, [("all_gather", h_bytes), *loss_fwd], [("reduce_scatter", h_bytes)])
    else:
        _assert_comm(tp_size, "head_loss", sp, loss_fwd, [("all_reduce", h_bytes)])
