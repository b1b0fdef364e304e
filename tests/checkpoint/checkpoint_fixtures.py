"""Tiny models, a deterministic plain training run and directory snapshots for the checkpoint tests."""

import hashlib
import os

import torch

from megamamba import MambaConfig, MambaLM
from megamamba.optim import param_groups
from megamamba.schedule.lr_schedule import LRSchedule

SSM = {
    "Mamba1": {"layer": "Mamba1", "d_state": 5, "dt_rank": 3},
    "Mamba2": {"layer": "Mamba2", "d_state": 6, "headdim": 6, "ngroups": 2, "chunk_size": 8},
}
SEQ, BATCH = 11, 3


def tiny(layer: str = "Mamba2", ssm: dict = None, **fields) -> MambaConfig:
    """d_model 18, 2 layers, vocab 37 (padded to 40); Mamba-2: 6 heads of 6 in 2 groups."""
    base = {"d_model": 18, "n_layer": 2, "vocab_size": 37}
    return MambaConfig(**{**base, **fields, "ssm_cfg": {**SSM[layer], **(ssm or {})}})


def perturbed_model(config: MambaConfig, seed: int) -> MambaLM:
    """The model's init plus noise on every parameter, so norms, D and biases are not their defaults."""
    torch.manual_seed(seed)
    model = MambaLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def assert_equal_but_the_vocabulary_padding(back: dict, ours: dict, config: MambaConfig) -> None:
    """Every tensor of the state dict `back` equals `ours`, except the embedding and head rows past the real
    vocabulary: transformers exports leave those padding rows out (no id reaches them, the loss leaves them out)
    and reading an export back makes them zero."""
    for key, value in ours.items():
        if key in ("backbone.embedding.weight", "lm_head.weight"):
            assert torch.equal(back[key][: config.vocab_size], value[: config.vocab_size]), key
            assert not back[key][config.vocab_size :].any(), key
        else:
            assert torch.equal(back[key], value), key


def training_run(config: MambaConfig, seed: int, tp=None):
    """(model, AdamW over the decay groups, warm-up + cosine scheduler): a fresh run initialised from `seed`
    (split over the tensor-parallel group `tp` when given)."""
    torch.manual_seed(seed)
    model = MambaLM(config, tp=tp)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, betas=(0.9, 0.95))
    scheduler = LRSchedule(1e-2, 1e-3, 2, 8).scheduler(optimizer)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, step: int) -> float:
    """One optimizer step on the batch of `step` (a function of the step alone); returns the loss.

    The batch takes its ids from torch's global generator after seeding it with the step, then
    re-seeds it from itself, so a run's RNG state carries over steps as real training code's would.
    """
    ids = torch.randint(
        0, model.config.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step)
    )
    noise = torch.randint(0, 2**31, (1,)).item()  # draws from the global generator: its state matters
    labels = ids[:, 1:].masked_fill((ids[:, 1:] + noise) % 7 == 0, -100)
    loss = model(ids[:, :-1], labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


def snapshot(directory: str) -> dict:
    """Relative path -> sha256 of every file under `directory` (directories as None)."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), directory)] = None
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), directory)] = hashlib.sha256(fh.read()).hexdigest()
    return out
