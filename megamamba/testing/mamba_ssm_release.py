"""mamba_ssm's kernels, references and model, loaded from its unpacked source release (the folder
holding mamba_ssm/) to run beside ours: its compiled extension stubbed, each autotuned Triton kernel
left one configuration, and on the CPU the CUDA device context and SM count its kernels ask for.
Where no release is loaded, `stand_in` plays its entry points with ours."""

import contextlib
import json
import os
import sys
import types

import torch

CHOICES = "autotune_choices.json"  # beside mamba_ssm/ in its source folder, written by the GPU check's triton_cache.py


def names_only_module(name):
    """A stand-in module every public name can be imported from (mamba_ssm's generation helpers
    import transformers, which the GPU machine lacks; training never uses them)."""
    module = types.ModuleType(name)

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return object

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def load(src: str):
    """mamba_ssm from its unpacked source release (the folder holding mamba_ssm/) with its compiled
    extension stubbed: a namespace of the entry points we compare with, or (None, why not).

    Every autotuned Triton kernel of mamba_ssm keeps one configuration, so its first use compiles
    one kernel per shape instead of timing a dozen: the one <src>/autotune_choices.json names (the
    first of its list that fits an sm_90 block at every shape the GPU check runs, found by its
    triton_cache.py), else its first.
    """
    if not src or not os.path.isdir(os.path.join(src, "mamba_ssm")):
        return None, f"no mamba_ssm/ under {src!r}"
    if src not in sys.path:
        sys.path.insert(0, src)
    sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
    try:
        import transformers.generation  # noqa: F401
    except ImportError:
        stubbed = ("transformers", "transformers.generation", "transformers.utils", "transformers.utils.hub")
        sys.modules.update({name: names_only_module(name) for name in stubbed})
    try:
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel
        from mamba_ssm.ops.selective_scan_interface import selective_scan_ref
        from mamba_ssm.ops.triton.layer_norm import rms_norm_fn
        from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as exc:  # noqa: BLE001 - reported as the reason, the caller goes on without it
        return None, f"import failed: {exc!r:.300}"
    path = os.path.join(src, CHOICES)
    choices = {}
    if os.path.exists(path):
        with open(path) as f:
            choices = json.load(f)
    tuners = autotuners("mamba_ssm.ops.triton")
    cap_autotuning(tuners, choices)
    picked = ", ".join(f"{name} #{index}" for name, index in sorted(choices.items()) if index) or "none"
    return types.SimpleNamespace(
        mamba_chunk_scan_combined=mamba_chunk_scan_combined,
        rmsnorm_fn=rmsnorm_fn,
        rms_norm_fn=rms_norm_fn,
        selective_scan_ref=selective_scan_ref,
        MambaLMHeadModel=MambaLMHeadModel,
        MambaConfig=MambaConfig,
    ), f"imported; {len(tuners)} autotuned kernels capped to one config each, the first except: {picked}" + (
        "" if choices else f" (no {path})"
    )


def autotuners(prefix: str) -> dict:
    """kernel name -> triton Autotuner, for the loaded modules under `prefix`."""
    from triton.runtime.autotuner import Autotuner, Heuristics

    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for attr, value in vars(module).items():
            while isinstance(value, Heuristics):
                value = value.fn
            if isinstance(value, Autotuner):
                found[attr] = value
    return found


def cap_autotuning(tuners: dict, choices: dict) -> None:
    """Leave each autotuner only its configuration number choices[name] (default 0, the last when
    past the end) of its original list; an autotuner with one configuration runs it unbenchmarked."""
    for name, tuner in tuners.items():
        configs = tuner.__dict__.setdefault("configs_before_cap", tuner.configs)
        tuner.configs = [configs[min(choices.get(name, 0), len(configs) - 1)]]


@contextlib.contextmanager
def cpu_stand_ins():
    """torch.cuda.device as a no-op and a two-SM device, while mamba_ssm's kernels run on CPU tensors."""
    saved = torch.cuda.device, torch.cuda.get_device_properties
    torch.cuda.device = lambda *args, **kwargs: contextlib.nullcontext()  # type: ignore[misc, assignment]
    torch.cuda.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(  # type: ignore[assignment]
        multi_processor_count=2, name="cpu", gcnArchName=""
    )
    try:
        yield
    finally:
        torch.cuda.device, torch.cuda.get_device_properties = saved  # type: ignore[misc]


class StandInConfig(types.SimpleNamespace):
    """mamba_ssm's MambaConfig played by ours: the fields as given."""


class StandInLMHeadModel(torch.nn.Module):
    """mamba_ssm's MambaLMHeadModel played by our MambaLM: its output under .logits, the same
    state-dict keys and parameter names (unprefixed)."""

    def __init__(self, config, device=None, dtype=None):
        super().__init__()
        from megamamba import MambaConfig, MambaLM

        self.model = MambaLM(MambaConfig.from_dict(vars(config))).to(device=device, dtype=dtype)

    def forward(self, input_ids):
        return types.SimpleNamespace(logits=self.model(input_ids))

    def load_state_dict(self, state_dict, strict=True, assign=False):
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def named_parameters(self, *args, **kwargs):
        return self.model.named_parameters(*args, **kwargs)


def stand_in():
    """The namespace `load` gives, played by ours (the GPU check's dry run, the benchmarks' tests): our
    PyTorch reference ops for mamba_ssm's, our MambaLM for its model."""
    from megamamba.kernels.reference.add_norm import add_rmsnorm
    from megamamba.kernels.reference.norm import rmsnorm_gated
    from megamamba.kernels.reference.selective_scan import selective_scan
    from megamamba.kernels.reference.ssd import ssd_chunk_scan

    def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
        return rmsnorm_gated(x, weight, bias, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)

    def rms_norm_fn(x, weight, bias, residual=None, eps=1e-6, prenorm=False, residual_in_fp32=False):
        out = add_rmsnorm(x, residual, weight, eps=eps, residual_dtype=torch.float32 if residual_in_fp32 else None)
        return out if prenorm else out[0]

    return types.SimpleNamespace(
        mamba_chunk_scan_combined=ssd_chunk_scan,
        rmsnorm_fn=rmsnorm_fn,
        rms_norm_fn=rms_norm_fn,
        selective_scan_ref=selective_scan,
        MambaLMHeadModel=StandInLMHeadModel,
        MambaConfig=StandInConfig,
    )
