"""The project's numerical rule, shared by the tests and the benchmarks: an output is held to its
float64 reference by one relative error over the whole tensor, ||out - ref|| / ||ref||; the output
gradients are drawn from a seed, which a failure message names; a non-finite output never passes."""

import torch


def relative_error(out, ref) -> float:
    """||out - ref|| / ||ref|| over the whole tensor, in float64; inf when `out` holds a NaN or an
    infinity, so that no tolerance passes it (0 when both are exactly zero). The same values give the
    same error whatever the tensors' layouts (the norms sum in one order)."""
    out = torch.as_tensor(out).detach().double().contiguous()
    ref = torch.as_tensor(ref).detach().double().to(out.device).contiguous()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    difference, scale = (out - ref).norm().item(), ref.norm().item()
    if difference == 0:
        return 0.0
    return difference / scale if scale else float("inf")


def _tuple(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def errors_against_float64(fns: dict, reference, tensors: dict, seed: int, names=None, **options) -> dict:
    """{key: {output name or "d<input>": relative error}} of each fns[key](**tensors, **options) against
    reference(**float64 copies of the tensors, **options), which runs once: each output, then the gradient
    of every float input. The output gradients are one standard-normal draw per output from `seed`,
    rounded to the first function's output dtypes and given unchanged to every run (to the reference in
    float64). `names` labels the outputs in order (default out0, out1, ...)."""
    exact = {k: v.detach().double().requires_grad_() if v.is_floating_point() else v for k, v in tensors.items()}
    float_names = [k for k, v in exact.items() if v.is_floating_point()]
    refs = _tuple(reference(**exact, **options))
    names = names or [f"out{i}" for i in range(len(refs))]
    found: dict = {}
    cotangents: list = []
    ref_grads: tuple = ()
    for key, fn in fns.items():
        ins = {k: v.detach().clone().requires_grad_() if v.is_floating_point() else v for k, v in tensors.items()}
        outs = _tuple(fn(**ins, **options))
        assert len(outs) == len(refs), f"seed {seed}: {key} returns {len(outs)} outputs, the reference {len(refs)}"
        if not cotangents:
            gen = torch.Generator().manual_seed(seed)
            cotangents = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]
            ref_grads = torch.autograd.grad(refs, [exact[k] for k in float_names], [c.double() for c in cotangents])
        grads = torch.autograd.grad(
            outs, [ins[k] for k in float_names], [c.to(o.dtype) for c, o in zip(cotangents, outs)]
        )
        found[key] = {name: relative_error(o, r) for name, o, r in zip(names, outs, refs)}
        found[key].update({f"d{k}": relative_error(g, r) for k, g, r in zip(float_names, grads, ref_grads)})
    return found
