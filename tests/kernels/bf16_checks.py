"""bf16 checks of a kernel: each output and input gradient against float64, beside mamba_ssm's.

`errors` runs an op on bf16 inputs (float32 where the model keeps parameters in float32) and
the float64 oracle on the same values, with one seeded output gradient per output, rounded to
the dtype the op returns and given unchanged to both. `assert_within_theirs` holds ours to
RATIO times mamba_ssm's error on the same inputs; errors under FLOOR are float32 round-off
(400 times under bf16's 2**-8 step) and pass whatever theirs is; a non-finite output (its error
inf), ours or theirs, passes no bound.
"""

import math

from megamamba.testing.numerics import errors_against_float64

RATIO = 1.5
FLOOR = 1e-5


def errors(fn, oracle, tensors, seed, names=("out",), **options) -> dict:
    """{output name or 'd<input>': relative error} of fn(**tensors, **options) against
    oracle(**float64 copies, **options); `names` labels fn's outputs in order."""
    return errors_of({"fn": fn}, oracle, tensors, seed, names, **options)["fn"]


def errors_of(fns: dict, oracle, tensors, seed, names=("out",), **options) -> dict:
    """{key: errors(fn, ...)} for each fn of `fns`, the oracle run once; every fn gets the
    output gradients drawn from seed + 1, rounded to the first one's output dtypes."""
    return errors_against_float64(fns, oracle, tensors, seed + 1, names, **options)


def assert_within_theirs(ours: dict, theirs: dict, seed, ratio=RATIO):
    """Every quantity both measured: ours finite and at most ratio x theirs (or under FLOOR)."""
    table = " ".join(f"{k} {ours[k]:.1e}/{theirs[k]:.1e}" for k in theirs if k in ours)
    for name, err in theirs.items():
        if name not in ours:
            continue
        assert math.isfinite(err) and math.isfinite(ours[name]) and ours[name] <= max(ratio * err, FLOOR), (
            f"seed {seed}: {name} error {ours[name]:.2e} > {ratio} x mamba_ssm's {err:.2e} (ours/theirs: {table})"
        )
