"""A plain model + AdamW run resumes from a checkpoint bit for bit; the contents are layout-free and named.

Reference: 8 uninterrupted steps. Resumed: 4 steps, save, a fresh run built from ANOTHER seed
loads the checkpoint, 4 more steps. Losses, parameters and optimizer state must be equal
(torch.equal / ==), which needs the weights, both Adam moments, the step counts, the
scheduler's position (the lr of step 4) and the global RNG state (the batches draw from it).
"""

import random

import numpy as np
import pytest
import torch
from safetensors import safe_open

from checkpoint_fixtures import perturbed_model, tiny, train_step, training_run
from megamamba.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointWarning,
    capture_rng,
    load_model_tensors,
    load_training_checkpoint,
    model_tensors,
    open_checkpoint,
    optimizer_groups,
    restore_rng,
    save_checkpoint,
    save_training_checkpoint,
)
from megamamba.checkpoint.model_folder import load_model_folder
from megamamba.model.lm import MambaLM

STEPS, SAVE_AT = 8, 4


@pytest.mark.parametrize("layer,fields", [("Mamba1", {}), ("Mamba2", {}), ("Mamba2", {"tie_embeddings": False})])
def test_resume_continues_bit_identically_to_an_uninterrupted_run(tmp_path, layer, fields):
    config = tiny(layer, **fields)
    ref_run = training_run(config, seed=0)
    reference = [train_step(*ref_run, step) for step in range(STEPS)]

    first = training_run(config, seed=0)
    losses = [train_step(*first, step) for step in range(SAVE_AT)]
    save_training_checkpoint(str(tmp_path), SAVE_AT, *first)
    torch.manual_seed(12345)  # the resumed process's own RNG state, which loading must replace

    resumed = training_run(config, seed=99)
    step = load_training_checkpoint(open_checkpoint("auto", str(tmp_path)), *resumed)
    assert step == SAVE_AT
    losses += [train_step(*resumed, s) for s in range(SAVE_AT, STEPS)]

    assert all(np.isfinite(losses)), losses
    assert losses == reference, f"resumed {losses}\nreference {reference}"
    for (name, a), b in zip(ref_run[0].named_parameters(), resumed[0].parameters()):
        assert torch.equal(a, b), name
        ref_state, state = ref_run[1].state[a], resumed[1].state[b]
        assert all(torch.equal(ref_state[k], state[k]) for k in ("exp_avg", "exp_avg_sq", "step")), name


def test_checkpoint_holds_full_tensors_under_mamba_ssm_names(tmp_path):
    config = tiny("Mamba2")
    model, optimizer, scheduler = training_run(config, seed=0)
    train_step(model, optimizer, scheduler, 0)
    path = save_training_checkpoint(str(tmp_path), 1, model, optimizer, scheduler)

    params = dict(model.named_parameters())
    assert "lm_head.weight" not in params  # tied: the embedding's tensor
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        assert set(f.keys()) == set(params)
        assert f.get_slice("backbone.embedding.weight").get_shape() == [config.padded_vocab_size, config.d_model]
    with safe_open(f"{path}/optimizer.safetensors", "pt") as f:
        assert set(f.keys()) == {f"{n}/{k}" for n in params for k in ("exp_avg", "exp_avg_sq", "step")}
        key = "backbone.layers.1.mixer.in_proj.weight"
        assert torch.equal(f.get_tensor(f"{key}/exp_avg"), optimizer.state[params[key]]["exp_avg"])
        assert f.get_tensor(f"{key}/step").item() == 1.0
    groups = open_checkpoint(path).optimizer_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert "backbone.layers.0.mixer.A_log" in groups[1]["params"]


def test_checkpoint_directory_is_a_model_folder(tmp_path):
    config = tiny("Mamba1")
    model = perturbed_model(config, seed=3)
    optimizer = torch.optim.AdamW(model.parameters())
    path = save_training_checkpoint(str(tmp_path), 0, model, optimizer)
    loaded = load_model_folder(path)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_resume_refuses_another_model_config_naming_every_differing_field(tmp_path):
    saved = training_run(tiny("Mamba2"), seed=0)
    save_training_checkpoint(str(tmp_path), 0, *saved)
    run = training_run(tiny("Mamba2", ssm={"d_state": 7}, residual_in_fp32=False), seed=1)
    before = {k: v.clone() for k, v in run[0].state_dict().items()}

    with pytest.raises(CheckpointError) as e:
        load_training_checkpoint(open_checkpoint("auto", str(tmp_path)), *run)
    message = str(e.value)
    assert "ssm_cfg.d_state: checkpoint 6, run 7" in message
    assert "residual_in_fp32: checkpoint True, run False" in message
    assert "ssm_cfg.headdim" not in message
    assert all(torch.equal(before[k], v) for k, v in run[0].state_dict().items())


def test_changed_optimizer_hyperparameters_warn_and_the_runs_values_apply(tmp_path):
    config = tiny("Mamba1")
    model, optimizer, scheduler = training_run(config, seed=0)
    train_step(model, optimizer, scheduler, 0)
    save_training_checkpoint(str(tmp_path), 1, model, optimizer, scheduler)
    model2, optimizer2, scheduler2 = training_run(config, seed=0)
    for group in optimizer2.param_groups:
        group["betas"] = (0.8, 0.95)

    with pytest.warns(CheckpointWarning, match=r"betas: checkpoint \[0.9, 0.95\], run \[0.8, 0.95\]"):
        load_training_checkpoint(open_checkpoint("auto", str(tmp_path)), model2, optimizer2, scheduler2)
    assert all(g["betas"] == (0.8, 0.95) for g in optimizer2.param_groups)
    assert optimizer2.param_groups[0]["lr"] == scheduler.get_last_lr()[0]


def test_a_checkpoint_saved_without_a_scheduler_resumes_the_schedule_at_its_step(tmp_path):
    config = tiny("Mamba2")
    model, optimizer, scheduler = training_run(config, seed=0)
    for step in range(3):
        train_step(model, optimizer, scheduler, step)
    save_training_checkpoint(str(tmp_path), 3, model, optimizer, scheduler=None)
    model2, optimizer2, scheduler2 = training_run(config, seed=1)

    assert load_training_checkpoint(open_checkpoint("auto", str(tmp_path)), model2, optimizer2, scheduler2) == 3
    assert scheduler2.last_epoch == scheduler.last_epoch == 3
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    assert [g["lr"] for g in optimizer2.param_groups] == [g["lr"] for g in optimizer.param_groups]


def test_rng_states_restore_python_numpy_and_torch():
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    np.random.standard_normal()  # leaves a cached Gaussian in NumPy's state
    state = capture_rng()
    draws = (random.random(), np.random.standard_normal(), torch.rand(3))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    restore_rng(state)
    again = (random.random(), np.random.standard_normal(), torch.rand(3))
    assert draws[0] == again[0] and draws[1] == again[1] and torch.equal(draws[2], again[2])


def test_each_rank_restores_its_own_rng_state_at_the_saved_world_size_else_rank_zeros(tmp_path):
    states = []
    for seed in range(4):
        torch.manual_seed(seed)
        states.append(capture_rng())
    config = tiny("Mamba1")
    ckpt = Checkpoint(save_checkpoint(str(tmp_path), 1, config, model_tensors(MambaLM(config)), rng=states))
    assert [ckpt.rng_state(r, 4)["torch"].tolist() for r in range(4)] == [s["torch"].tolist() for s in states]
    assert [ckpt.rng_state(r, 2)["torch"].tolist() for r in range(2)] == [states[0]["torch"].tolist()] * 2


def test_loaded_model_refuses_tensors_of_another_shape(tmp_path):
    model = perturbed_model(tiny("Mamba1"), seed=0)
    save_training_checkpoint(str(tmp_path), 0, model, torch.optim.AdamW(model.parameters()))
    other = MambaLM(tiny("Mamba1", d_model=20))
    with pytest.raises(CheckpointError, match=r"has shape \(40, 18\), the model \(40, 20\)"):
        load_model_tensors(other, open_checkpoint("auto", str(tmp_path)).model_tensors())


def test_groups_of_an_optimizer_over_flat_partitions_need_their_members():
    model = MambaLM(tiny("Mamba1"))
    params = list(model.parameters())
    flat = torch.nn.Parameter(torch.cat([p.detach().flatten() for p in params]))
    optimizer = torch.optim.AdamW([flat], weight_decay=0.1)
    with pytest.raises(
        CheckpointError,
        match=r"group 0 steps 1 tensor\(s\) that are not parameters of the model "
        r"\(pass `members`",
    ):
        optimizer_groups(optimizer, model)
    (group,) = optimizer_groups(optimizer, model, members=[params])
    assert group["params"] == [n for n, _ in model.named_parameters()] and group["weight_decay"] == 0.1
