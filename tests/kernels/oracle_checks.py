"""What the Triton kernel tests share: the check of an op on float32 inputs against its float64
oracle, output by output and gradient by gradient (megamamba.testing.numerics)."""

from megamamba.testing.numerics import errors_against_float64

TOL = 1e-4


def check_against_oracle(fn, oracle, tensors, seed, names=("out",), tol_by_grad=None, **kwargs):
    """fn on float32 copies of `tensors` vs oracle on float64 copies: each output (one per name in
    `names`; a tuple when there are several) within TOL, then, under output gradients drawn from
    seed + 1, the gradient of every float input within TOL (or tol_by_grad[input name])."""
    ins32 = {k: v.detach().float() if v.is_floating_point() else v for k, v in tensors.items()}
    errors = errors_against_float64({"fn": fn}, oracle, ins32, seed + 1, names=names, **kwargs)["fn"]
    for name in names:
        assert errors[name] != float("inf"), f"seed {seed}: non-finite {name}"
        assert errors[name] <= TOL, f"seed {seed}: {name} rel err {errors[name]:.2e}"
    for name, v in ins32.items():
        if v.is_floating_point():
            err = errors[f"d{name}"]
            assert err != float("inf"), f"seed {seed}: non-finite grad of {name}"
            assert err <= (tol_by_grad or {}).get(name, TOL), f"seed {seed}: grad of {name} rel err {err:.2e}"
