"""What the Triton kernel tests share: the relative error, and the check of an op on float32
inputs against its float64 oracle, output by output and gradient by gradient."""
import torch

TOL = 1e-4


def rel_err(out, ref):
    """‖out − ref‖ / ‖ref‖, in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_against_oracle(fn, oracle, tensors, seed, names=("out",), tol_by_grad=None, **kwargs):
    """fn on float32 copies of `tensors` vs oracle on float64 copies: each output (one per name in
    `names`; a tuple when there are several) within TOL, then, under seeded random output
    gradients, the gradient of every float input within TOL (or tol_by_grad[input name])."""
    ins32 = {k: v.detach().float().clone().requires_grad_() if v.is_floating_point() else v
             for k, v in tensors.items()}
    ins64 = {k: v.detach().double().clone().requires_grad_() if v.is_floating_point() else v
             for k, v in tensors.items()}
    outs, refs = fn(**ins32, **kwargs), oracle(**ins64, **kwargs)
    if len(names) == 1:
        outs, refs = (outs,), (refs,)
    for name, out, ref in zip(names, outs, refs):
        assert torch.isfinite(out).all(), f"seed {seed}: non-finite {name}"
        assert rel_err(out, ref) <= TOL, f"seed {seed}: {name} rel err {rel_err(out, ref):.2e}"
    gen = torch.Generator().manual_seed(seed + 1)
    cotangents = [torch.randn(ref.shape, generator=gen, dtype=torch.float64) for ref in refs]
    sum((out * c.float()).sum() for out, c in zip(outs, cotangents)).backward()
    sum((ref * c).sum() for ref, c in zip(refs, cotangents)).backward()
    for name, v in ins32.items():
        if v.is_floating_point():
            assert torch.isfinite(v.grad).all(), f"seed {seed}: non-finite grad of {name}"
            err = rel_err(v.grad, ins64[name].grad)
            assert err <= (tol_by_grad or {}).get(name, TOL), f"seed {seed}: grad of {name} rel err {err:.2e}"
