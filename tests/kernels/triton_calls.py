"""Forcing an op onto Triton in a test and proving its Triton forward and backward really ran."""

import contextlib


@contextlib.contextmanager
def triton_forward_and_backward_run(monkeypatch, module, label: str):
    """MEGAMAMBA_KERNELS=triton (on CPU tensors: the interpreter) while inside; on leaving, fail unless both
    `module.forward` and `module.backward` (megamamba.kernels.triton.<op>) were called."""
    monkeypatch.setenv("MEGAMAMBA_KERNELS", "triton")
    calls = set()
    for name in ("forward", "backward"):
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _fn=fn, _name=name, **k: calls.add(_name) or _fn(*a, **k))
    yield
    assert calls == {"forward", "backward"}, f"of Triton's {label} only {sorted(calls)} ran"
