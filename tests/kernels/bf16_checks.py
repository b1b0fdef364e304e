"""bf16 checks of a kernel: each output and input gradient against float64, beside mamba_ssm's.

`errors` runs an op on bf16 inputs (float32 where the model keeps parameters in float32) and
the float64 oracle on the same values, with one seeded output gradient per output, rounded to
the dtype the op returns and given unchanged to both. `assert_within_theirs` holds ours to
RATIO times mamba_ssm's error on the same inputs; errors under FLOOR are float32 round-off
(400 times under bf16's 2**-8 step) and pass whatever theirs is.
"""
import torch

RATIO = 1.5
FLOOR = 1e-5


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf when out is not finite."""
    out = out.double()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return ((out - ref.double()).norm() / ref.double().norm()).item()


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def errors(fn, oracle, tensors, seed, names=("out",), **options) -> dict:
    """{output name or 'd<input>': relative error} of fn(**tensors, **options) against
    oracle(**float64 copies, **options); `names` labels fn's outputs in order."""
    ours_in = {k: v.detach().clone().requires_grad_() if v.is_floating_point() else v for k, v in tensors.items()}
    exact_in = {k: v.detach().double().requires_grad_() if v.is_floating_point() else v for k, v in tensors.items()}
    outs, refs = _outputs(fn(**ours_in, **options)), _outputs(oracle(**exact_in, **options))
    gen = torch.Generator().manual_seed(seed + 1)
    cotangents = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]
    float_names = [k for k, v in ours_in.items() if v.is_floating_point()]
    grads = torch.autograd.grad(outs, [ours_in[k] for k in float_names], cotangents)
    ref_grads = torch.autograd.grad(refs, [exact_in[k] for k in float_names], [c.double() for c in cotangents])
    found = {name: rel_err(o, r) for name, o, r in zip(names, outs, refs)}
    found.update({f"d{k}": rel_err(g, r) for k, g, r in zip(float_names, grads, ref_grads)})
    return found


def assert_within_theirs(ours: dict, theirs: dict, seed, ratio=RATIO):
    """Every quantity both measured: ours finite and at most ratio x theirs (or under FLOOR)."""
    table = " ".join(f"{k} {ours[k]:.1e}/{theirs[k]:.1e}" for k in theirs if k in ours)
    for name, err in theirs.items():
        if name not in ours:
            continue
        assert ours[name] <= max(ratio * err, FLOOR), \
            f"seed {seed}: {name} error {ours[name]:.2e} > {ratio} x mamba_ssm's {err:.2e} (ours/theirs: {table})"
