"""Helpers of the tensor- and context-parallel model tests (importable as `model_checks`)."""
import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out is not finite (NaN never passes)."""
    out = out.detach()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every parameter off its initial value (zeros, ones), so no gradient is trivially exact."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
