"""Blending datasets by weight: the `--data` list and the schedule that mixes samples.

Weights kept exact as fractions; `BlendSchedule` places samples by the Sainte-Laguë divisor
method, in closed form and without randomness, so every prefix holds each dataset's share within
n + 1 samples. The derivation: docs/data.md ("The data code").
"""

import math
from fractions import Fraction
from typing import Sequence


def parse_blend(args: Sequence[str]) -> list[tuple[Fraction, str]]:
    """`--data` values -> [(normalised weight, prefix)]: one prefix, or pairs "weight prefix ..."."""
    args = list(args)
    if not args:
        raise ValueError("--data: no dataset given (a prefix, or pairs of weight and prefix)")
    if len(args) == 1:
        return [(Fraction(1), args[0])]
    if len(args) % 2:
        raise ValueError(f"--data {' '.join(args)}: expected pairs 'weight prefix', got {len(args)} values")
    weights = []
    for w in args[0::2]:
        try:
            weight = Fraction(w)
        except ValueError:
            raise ValueError(f"--data: weight {w!r} is not a number (expected pairs 'weight prefix')") from None
        if weight <= 0:
            raise ValueError(f"--data: weight {w!r} must be positive")
        weights.append(weight)
    total = sum(weights)
    return [(w / total, prefix) for w, prefix in zip(weights, args[1::2])]


class BlendSchedule:
    """Global sample j -> (dataset i, that dataset's sample number q)."""

    def __init__(self, weights: Sequence):
        if not weights or any(w <= 0 for w in weights):
            raise ValueError(f"blend weights {list(weights)}: need at least one, all positive")
        exact = [Fraction(w) for w in weights]
        total = sum(exact)
        self.weights = [w / total for w in exact]

    def _count_before(self, time: Fraction) -> list[int]:
        """Samples of each dataset whose time is < `time`: #{q >= 0 : (q + 1/2) / w < time}."""
        return [max(0, math.ceil(time * w - Fraction(1, 2))) for w in self.weights]

    def assign(self, first: int, stop: int) -> list[tuple[int, int]]:
        """(dataset, sample number) of global samples first .. stop-1."""
        n = len(self.weights)
        # Dataset i has between T*w_i - 1/2 and T*w_i + 1/2 samples before time T, so all of them
        # together between T - n/2 and T + n/2: the window [first - n, stop + n) holds the range.
        low = self._count_before(Fraction(max(0, first - n)))
        high = self._count_before(Fraction(stop + n))
        points = sorted(
            ((Fraction(2 * q + 1, 2) / w, i, q) for i, w in enumerate(self.weights) for q in range(low[i], high[i]))
        )
        base = sum(low)
        assert base <= first and base + len(points) >= stop, "blend window does not cover the range"
        return [(i, q) for _, i, q in points[first - base : stop - base]]
