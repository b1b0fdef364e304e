"""Helpers of the tensor- and context-parallel model tests (importable as `model_checks`)."""

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from megamamba import MambaLM
from megamamba.model.loss import lm_loss
from megamamba.parallel import (
    TensorParallel,
    full_key,
    full_tensors,
    gather_from_tp_region,
    load_full_tensors,
    local_shard,
)
from megamamba.parallel.context.context_parallel import sequence_slice
from megamamba.testing.numerics import relative_error

NO_GROUP = object()  # stands in for a process group: building a TP model communicates nothing


def rank_of(size: int, rank: int = 0, sp: bool = False) -> TensorParallel:
    """Rank `rank` of a TP group of `size`, without processes (anything that communicated would fail)."""
    return TensorParallel(NO_GROUP, size, rank, sequence_parallel=sp)


def parameters_not_their_slices(cfg, tp_size: int, rank: int, seed: int) -> list:
    """The names of the TP rank's parameters that are not its slices of the single-device model, both built
    from `seed` (none: the same seed builds the same model at any TP size)."""
    torch.manual_seed(seed)
    plain = dict(MambaLM(cfg).named_parameters())
    torch.manual_seed(seed)
    model = MambaLM(cfg, tp=rank_of(tp_size, rank))
    wrong = []
    for name, p in model.named_parameters():
        shard = getattr(p, "tp_shard", None)
        key = full_key(name, p)
        expected = plain[key] if shard is None else local_shard(plain[key].detach(), shard, tp_size, rank)
        if not torch.equal(p.detach(), expected):
            wrong.append(name)
    return wrong


def assert_equal_to_single_process(results: list, where: str, tol: float = 1e-5) -> None:
    """Every rank's relative errors (a `*_parallel_errors` result each) of logits, loss and every gradient
    within `tol`, the parameter names the same."""
    for rank, r in enumerate(results):
        at = f"{where}, rank {rank}"
        assert r["grad_keys"], f"{at}: parameter names differ"
        worst = max(r["grads"], key=r["grads"].get)
        assert r["logits"] <= tol and r["loss"] <= tol, f"{at}: logits {r['logits']:.2e}, loss {r['loss']:.2e}"
        assert r["grads"][worst] <= tol, f"{at}: gradient of {worst} off by {r['grads'][worst]:.2e}"


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every parameter off its initial value (zeros, ones), so no gradient is trivially exact."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def recompute_blocks_in_backward(model: torch.nn.Module) -> None:
    """Activation checkpointing of every block, as pipelines/stages/pipeline_module.py does (non-reentrant)."""
    for block in model.backbone.layers:
        forward = block.forward
        block.forward = lambda *args, _forward=forward, **kwargs: checkpoint(
            _forward, *args, use_reentrant=False, **kwargs
        )


def context_parallel_errors(cfg, inputs, cp, tp=None, seed: int = 0, prepare=None) -> dict:
    """Relative errors of the context-parallel (x TP) model against the single-process model with the same
    weights (built from `seed`, perturbed): logits of this rank's slice (gathered over the vocab under TP),
    the whole-sequence loss, and every parameter's gradient summed over the CP group (as the reduction over
    dp x cp does). `inputs` = (ids, labels, seq_idx) of the whole sequences; `prepare(model)` runs before
    the forward (to wrap blocks, say)."""
    torch.manual_seed(seed)
    plain = MambaLM(cfg)
    perturb(plain, seed + 2)
    torch.manual_seed(seed)
    model = MambaLM(cfg, tp=tp, cp=cp)
    if tp is None:
        model.load_state_dict(plain.state_dict())
    else:
        load_full_tensors(model, dict(plain.named_parameters()), tp)
    if prepare is not None:
        prepare(model)
    ids, labels, seq_idx = inputs
    ref_logits = plain(ids, seq_idx=seq_idx)
    ref_loss = lm_loss(ref_logits, labels, cfg.vocab_size)
    ref_loss.backward()
    local_ids, local_labels, local_seq_idx = (None if t is None else sequence_slice(t, cp) for t in inputs)
    logits = model(local_ids, seq_idx=local_seq_idx)
    loss = lm_loss(logits, local_labels, cfg.vocab_size, tp, cp)
    loss.backward()
    if tp is not None:
        logits = gather_from_tp_region(logits.detach(), tp)[..., : cfg.padded_vocab_size]
        grads = full_tensors(model, tp, lambda p: p.grad)
    else:
        grads = {name: p.grad for name, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g, group=cp.group)
    ref_grads = {name: p.grad for name, p in plain.named_parameters()}
    return dict(
        logits=relative_error(logits, sequence_slice(ref_logits, cp)),
        loss=relative_error(loss, ref_loss),
        grad_keys=sorted(grads) == sorted(ref_grads),
        grads={name: relative_error(grads[name], g) for name, g in ref_grads.items()},
    )


def tensor_parallel_errors(cfg, inputs, tp: TensorParallel, seed: int, steps: int = 0) -> dict:
    """Relative errors of the tensor-parallel model against the single-device model: both built from `seed`
    (init_equal: the same weights), the single-device weights perturbed and loaded as full tensors; logits
    gathered over the vocab, the loss, every parameter gradient gathered to its full shape (local_vocab: the
    rank's logit columns). `inputs` = (ids, labels, seq_idx); with `steps`, the worst error of the first
    `steps` recurrent steps (`step`)."""
    torch.manual_seed(seed)
    plain = MambaLM(cfg)
    torch.manual_seed(seed)
    model = MambaLM(cfg, tp=tp)
    init_equal = all(torch.equal(full_tensors(model, tp)[k], v) for k, v in plain.named_parameters())
    perturb(plain, seed + 2)
    load_full_tensors(model, dict(plain.named_parameters()), tp)

    ids, labels, seq_idx = inputs
    ref_logits = plain(ids, seq_idx=seq_idx)
    ref_loss = lm_loss(ref_logits, labels, cfg.vocab_size)
    ref_loss.backward()
    logits = model(ids, seq_idx=seq_idx)
    loss = lm_loss(logits, labels, cfg.vocab_size, tp)
    loss.backward()

    full_logits = gather_from_tp_region(logits.detach(), tp)[..., : cfg.padded_vocab_size]
    grads = full_tensors(model, tp, lambda p: p.grad)
    ref_grads = {k: p.grad for k, p in plain.named_parameters()}
    result = dict(
        init_equal=init_equal,
        logits=relative_error(full_logits, ref_logits),
        loss=relative_error(loss, ref_loss),
        loss_value=loss.item(),
        local_vocab=logits.shape[-1],
        grad_keys=sorted(grads) == sorted(ref_grads),
        grads={k: relative_error(grads[k], g) for k, g in ref_grads.items()},
    )
    if steps:
        result["step"] = _step_error(plain, model, ids[:, :steps], tp)
    return result


def _step_error(plain, model, ids, tp) -> float:
    """The worst relative error of the TP model's token-by-token steps (its KV caches and states hold this
    rank's heads and channels) against the single-device model's."""
    with torch.no_grad():
        ref_cache, cache = plain.allocate_inference_cache(ids.shape[0]), model.allocate_inference_cache(ids.shape[0])
        worst = 0.0
        for t in range(ids.shape[1]):
            ref = plain.step(ids[:, t], ref_cache)
            out = gather_from_tp_region(model.step(ids[:, t], cache), tp)[..., : ref.shape[-1]]
            worst = max(worst, relative_error(out, ref))
    return worst
