"""bf16 checks of a kernel: each output and input gradient against float64, beside mamba_ssm's.

`errors` runs an op on bf16 inputs (float32 where the model keeps parameters in float32) and
the float64 oracle on the same values, with one seeded output gradient per output, rounded to
the dtype the op returns and given unchanged to both. `assert_within_theirs` holds ours to
RATIO times mamba_ssm's error on the same inputs; errors under FLOOR are float32 round-off
(400 times under bf16's 2**-8 step) and pass whatever theirs is; a non-finite error (NaN) passes
no bound.
"""
import torch

from oracle_checks import rel_err

RATIO = 1.5
FLOOR = 1e-5


def _outputs(result):
    return result if isinstance(result, tuple) else (result,)


def errors(fn, oracle, tensors, seed, names=("out",), **options) -> dict:
    """{output name or 'd<input>': relative error} of fn(**tensors, **options) against
    oracle(**float64 copies, **options); `names` labels fn's outputs in order."""
    return errors_of({"fn": fn}, oracle, tensors, seed, names, **options)["fn"]


def errors_of(fns: dict, oracle, tensors, seed, names=("out",), **options) -> dict:
    """{key: errors(fn, ...)} for each fn of `fns`, the oracle run once; every fn gets the
    cotangents rounded to the first one's output dtypes."""
    exact_in = {k: v.detach().double().requires_grad_() if v.is_floating_point() else v for k, v in tensors.items()}
    float_names = [k for k, v in exact_in.items() if v.is_floating_point()]
    refs = _outputs(oracle(**exact_in, **options))
    found, cotangents, ref_grads = {}, None, None
    for key, fn in fns.items():
        ins = {k: v.detach().clone().requires_grad_() if v.is_floating_point() else v for k, v in tensors.items()}
        outs = _outputs(fn(**ins, **options))
        if cotangents is None:
            gen = torch.Generator().manual_seed(seed + 1)
            cotangents = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]
            ref_grads = torch.autograd.grad(refs, [exact_in[k] for k in float_names], [c.double() for c in cotangents])
        grads = torch.autograd.grad(outs, [ins[k] for k in float_names],
                                    [c.to(o.dtype) for c, o in zip(cotangents, outs)])
        found[key] = {name: rel_err(o, r) for name, o, r in zip(names, outs, refs)}
        found[key].update({f"d{k}": rel_err(g, r) for k, g, r in zip(float_names, grads, ref_grads)})
    return found


def assert_within_theirs(ours: dict, theirs: dict, seed, ratio=RATIO):
    """Every quantity both measured: ours finite and at most ratio x theirs (or under FLOOR)."""
    table = " ".join(f"{k} {ours[k]:.1e}/{theirs[k]:.1e}" for k in theirs if k in ours)
    for name, err in theirs.items():
        if name not in ours:
            continue
        assert ours[name] <= max(ratio * err, FLOOR), \
            f"seed {seed}: {name} error {ours[name]:.2e} > {ratio} x mamba_ssm's {err:.2e} (ours/theirs: {table})"
