"""Pipeline layers built without their default initialisation.

A pipeline stage's weights are copied in after it is built (`pipelines.loop.engine.InitialState`, or a
checkpoint), so the draws every layer makes in its constructor (under TP: full tensors, then
sliced) are wasted start-up time. These specs run the constructor on the meta device, where
nothing is drawn or stored, then give each parameter uninitialised storage on the accelerator's
current device, where DeepSpeed's PipelineModule would move it. Parameters keep their attributes
(`tp_shard`, `tensor_model_parallel`, `_no_weight_decay`, ...) and their sharing within a layer.
A layer holding buffers or other tensors is refused: their values would be lost.
"""

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn


def build_uninitialised(spec: LayerSpec) -> nn.Module:
    """`spec`'s layer with uninitialised parameters on the accelerator's current device."""
    with torch.device("meta"):
        module = spec.typename(*spec.module_args, **spec.module_kwargs)
    _refuse_other_tensors(module)
    _give_storage(module, torch.device(get_accelerator().current_device_name()))
    return module


def _refuse_other_tensors(module: nn.Module) -> None:
    for name, sub in module.named_modules():
        held = [f"buffer {n}" for n, _ in sub.named_buffers(recurse=False)]
        held += [f"tensor {n}" for n, v in vars(sub).items() if isinstance(v, torch.Tensor)]
        if held:
            raise TypeError(
                f"{type(module).__name__} holds {held} in {name or 'itself'}: only parameters can be "
                "built uninitialised, a buffer's or tensor's value would be lost"
            )


def _give_storage(module: nn.Module, device: torch.device) -> None:
    """Replace every meta parameter by an uninitialised one on `device` with the same attributes; a parameter
    registered in several places stays one."""
    replaced = {}  # id of a meta parameter -> (it, kept alive so its id stays its own; its replacement)
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False, remove_duplicate=False)):
            if id(param) not in replaced:
                new = nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)
                replaced[id(param)] = (param, new)
            setattr(sub, name, replaced[id(param)][1])


class UninitialisedLayerSpec(LayerSpec):
    """A LayerSpec whose layer comes with uninitialised parameters (`build_uninitialised`)."""

    def build(self, log: bool = False) -> nn.Module:
        return build_uninitialised(self)


class UninitialisedTiedLayerSpec(TiedLayerSpec):
    """A TiedLayerSpec whose layer comes with uninitialised parameters (`build_uninitialised`)."""

    def build(self, log: bool = False) -> nn.Module:
        return build_uninitialised(self)
