"""--init-from DIR and --finetune: training starts at a folder's weights, at step 0, with a fresh optimizer.

The folders: a checkpoint written after one AdamW step of a MambaLM drawn with another seed than
the run's (so it holds optimizer state that must not be loaded), and its transformers export
(megamamba.checkpoint.convert). The first logged loss must equal the loss that a plain MambaLM loaded from
the folder (float64) gives on the run's first global batch. The runs use ZeRO-1, whose optimizer
steps fp32 master copies of the weights: the second loss must equal that of a run without ZeRO
(its optimizer steps the module's own weights) from the same folder, else the first step went
back to the run's initial weights.
"""

import json
import os
import shutil

import pytest
import torch

from megamamba.checkpoint import CheckpointError, save_training_checkpoint
from megamamba.checkpoint.convert import export_hf, import_weights
from megamamba.checkpoint.model_folder import FolderWeights, load_model_folder
from megamamba.config import MambaConfig
from megamamba.model.lm import MambaLM
from megamamba.model.loss import lm_loss
from megamamba.optim import param_groups
from megamamba.pipelines.job import init_from
from train_entry import load_train_script
from train_runs import COMMON

FOLDER_SEED, SAVED_STEP = 7, 3
SHORT = ["--train-iters", "2", "--eval-interval", "0"]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def folders(train_runs, tmp_path_factory):
    """{"checkpoint": step folder after one AdamW step, "hf": its transformers export, "config": path}."""
    root = tmp_path_factory.mktemp("init_from")
    config_path = train_runs.model_config("mamba2")
    torch.manual_seed(FOLDER_SEED)
    model = MambaLM(MambaConfig.from_json(config_path))
    # the run's groups and betas, and a scheduler: one test resumes from it
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-2, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randint(0, 256, (2, 16))).float().pow(2).mean().backward()
    optimizer.step()
    scheduler.step()
    checkpoint = save_training_checkpoint(str(root / "save"), SAVED_STEP, model, optimizer, scheduler)
    hf = export_hf(checkpoint, str(root / "hf"))
    return {"checkpoint": checkpoint, "hf": hf, "config": config_path, "root": root}


def first_batch_loss(model: MambaLM, argv: list) -> float:
    """The mean loss of `model` over the first global batch of the run `argv` describes (float64)."""
    train = load_train_script()
    plan = train.prepare(train.parse_args(argv), world_size=1)
    batches = plan.data.train.micro_batches(0, 0, 1, plan.layout.micro_batch_size)
    model = model.to(torch.float64)
    with torch.no_grad():
        losses = [
            lm_loss(model(inputs, seq_idx=seq_idx), labels, plan.model.vocab_size)
            for inputs, labels, seq_idx in batches
        ]
    return torch.stack(losses).mean().item()


def run_argv(train_runs, folders) -> list:
    """The flags of the runs below, without the initial weights (they do not change the data or the LR)."""
    return ["--deepspeed_config", str(train_runs.ds_config()), "--model-config", folders["config"], *COMMON, *SHORT]


@pytest.fixture(scope="module")
def second_loss_without_zero(train_runs, folders) -> float:
    """Step 1's loss of a run at (1,1,1) with ZeRO stage 0 initialized from the checkpoint."""
    run = train_runs.launched(
        1,
        "mamba2",
        [*SHORT, "--init-from", folders["checkpoint"]],
        ds_config=train_runs.ds_config(zero_optimization={"stage": 0}),
    )
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    assert [r["step"] for r in run["records"]] == [0, 1]
    return run["records"][1]["loss"]


def check_started_at_weights(run, reference_loss: float, second_loss: float, argv: list) -> None:
    """Steps 0 and 1 logged, the first loss the folder model's, the second `second_loss` (the
    optimizer stepped from the folder's weights), the LR the fresh schedule's step 0."""
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    records = run["records"]
    assert [r["step"] for r in records] == [0, 1]
    first, second = records[0]["loss"], records[1]["loss"]
    assert first == first and abs(first - reference_loss) / abs(reference_loss) <= TOLERANCE, (first, reference_loss)
    assert second == second and abs(second - second_loss) / abs(second_loss) <= TOLERANCE, (second, second_loss)
    train = load_train_script()
    fresh = train.prepare(train.parse_args(argv), world_size=1).schedule
    assert records[0]["lr"] == pytest.approx(fresh(0), rel=1e-12)


@pytest.mark.slow
def test_init_from_a_transformers_export_starts_at_its_weights_at_step_0(train_runs, folders, second_loss_without_zero):
    imported = import_weights("hf", folders["hf"], str(folders["root"] / "imported"))
    argv = run_argv(train_runs, folders)
    run = train_runs.launched(1, "mamba2", [*SHORT, "--init-from", folders["hf"]])
    first_loss = first_batch_loss(load_model_folder(imported), argv)
    check_started_at_weights(run, first_loss, second_loss_without_zero, argv)
    assert (
        f"train.py: initialized from {folders['hf']} (transformers Mamba2ForCausalLM folder, not verified: no "
        "manifest.json): step 0, fresh optimizer"
    ) in run["stdout"]


@pytest.mark.slow
def test_init_from_a_checkpoint_at_tensor_parallel_2_starts_at_its_weights_verified(
    train_runs, folders, second_loss_without_zero
):
    argv = run_argv(train_runs, folders)
    run = train_runs.launched(
        2, "mamba2", [*SHORT, "--tensor-parallel-size", "2", "--init-from", folders["checkpoint"]]
    )
    first_loss = first_batch_loss(load_model_folder(folders["checkpoint"]), argv)
    check_started_at_weights(run, first_loss, second_loss_without_zero, argv)
    assert (
        f"train.py: initialized from {folders['checkpoint']} (checkpoint of step {SAVED_STEP}, verified: sizes "
        "and sha256 of"
    ) in run["stdout"]
    assert "resumed from" not in run["stdout"]


@pytest.mark.slow
def test_finetune_takes_only_the_weights_of_load(train_runs, folders, second_loss_without_zero):
    argv = run_argv(train_runs, folders)
    run = train_runs.launched(1, "mamba2", [*SHORT, "--finetune", "--load", folders["checkpoint"]])
    first_loss = first_batch_loss(load_model_folder(folders["checkpoint"]), argv)
    check_started_at_weights(run, first_loss, second_loss_without_zero, argv)
    assert f"train.py: initialized from {folders['checkpoint']} (checkpoint of step {SAVED_STEP}" in run["stdout"]


@pytest.mark.slow
def test_a_checkpoint_that_load_finds_wins_over_init_from(train_runs, folders):
    save = folders["root"] / "requeued"
    shutil.copytree(os.path.dirname(folders["checkpoint"]), save)
    run = train_runs.launched(
        1,
        "mamba2",
        [
            "--train-iters",
            str(SAVED_STEP + 1),
            "--eval-interval",
            "0",
            "--init-from",
            folders["hf"],
            "--save",
            str(save),
            "--load",
            "auto",
        ],
    )
    assert run["returncode"] == 0, run["stdout"][-3000:] + run["stderr"][-3000:]
    assert [r["step"] for r in run["records"]] == [SAVED_STEP]
    assert f"train.py: --init-from {folders['hf']} not used: --load found" in run["stdout"]
    assert "initialized from" not in run["stdout"]


@pytest.mark.slow
def test_a_run_whose_config_differs_from_the_folder_is_refused_in_one_line(train_runs, folders):
    run = train_runs.launched(1, "mamba1", [*SHORT, "--init-from", folders["checkpoint"]])
    assert run["returncode"] == 2
    lines = [line for line in run["stderr"].splitlines() if "train.py: error:" in line]
    assert lines and "the model config of" in lines[0] and "ssm_cfg.layer: folder 'Mamba2', run 'Mamba1'" in lines[0]


def test_config_differences_are_refused_by_name(folders):
    run = MambaConfig.from_dict({**json.load(open(folders["config"])), "d_model": 32})
    with pytest.raises(CheckpointError, match=r"--init-from X: .*d_model: folder 64, run 32"):
        init_from.check_config(FolderWeights(folders["checkpoint"]), run, "--init-from X")


def test_a_transformers_export_holds_the_runs_vocabulary_and_padding(folders):
    run = MambaConfig.from_json(folders["config"])
    weights = FolderWeights(folders["hf"])
    assert (weights.config.vocab_size, weights.config.pad_vocab_size_multiple) == (run.vocab_size, 8)
    init_from.check_config(weights, run, "--init-from X")


def test_an_older_transformers_export_counts_its_padded_vocabulary_as_the_runs(folders):
    """Exports written before they left the padding rows out stored vocab_size = the padded row count."""
    run = MambaConfig.from_json(folders["config"])
    older = folders["root"] / "older-hf"
    shutil.copytree(folders["hf"], older)
    fields = json.loads((older / "config.json").read_text())
    del fields["pad_vocab_size_multiple"]
    (older / "config.json").write_text(json.dumps({**fields, "vocab_size": run.padded_vocab_size}))
    weights = FolderWeights(str(older))
    assert weights.config.vocab_size == run.padded_vocab_size != run.vocab_size
    init_from.check_config(weights, run, "--init-from X")


def test_a_checkpoint_with_a_flipped_bit_is_refused(folders):
    damaged = folders["root"] / "flipped"
    shutil.copytree(folders["checkpoint"], damaged)
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x10  # inside the last tensor's data, past the header
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: sha256 differs"):
        init_from.describe_source(str(damaged), "--init-from")


def test_a_plain_folder_is_read_unverified_and_a_checkpoint_verified(folders):
    assert init_from.describe_source(folders["hf"], "--init-from") == (folders["hf"], "not verified: no manifest.json")
    folder, note = init_from.describe_source(os.path.dirname(folders["checkpoint"]), "--init-from")
    assert folder.endswith(os.path.basename(folders["checkpoint"]))
    assert note.startswith(f"checkpoint of step {SAVED_STEP}, verified: sizes and sha256 of ")


@pytest.mark.parametrize(
    "init, finetune, load, message",
    [
        (None, True, None, "--finetune takes the weights of --load, but --load is not set"),
        ("D", True, "C", "both name the initial weights"),
        (None, True, "auto", "--finetune --load auto"),
        ("/no/such/dir", False, None, "--init-from /no/such/dir: no such directory"),
    ],
)
def test_start_up_refuses_contradictory_initial_weights(init, finetune, load, message):
    with pytest.raises(ValueError, match=message):
        init_from.check_flags(init, finetune, load)


def test_a_mamba_ssm_folder_with_pytorch_model_bin_gives_the_same_tensors(folders):
    source = FolderWeights(folders["checkpoint"])
    names = sorted(source.shapes())
    original = source.tensors(names)
    folder = folders["root"] / "mamba_ssm"
    folder.mkdir()
    shutil.copyfile(os.path.join(folders["checkpoint"], "config.json"), folder / "config.json")
    torch.save(original, folder / "pytorch_model.bin")
    weights = FolderWeights(str(folder))
    assert weights.kind == "mamba_ssm folder (pytorch_model.bin)"
    assert weights.shapes() == source.shapes()
    read = weights.tensors([*names, "lm_head.weight"])
    assert all(torch.equal(read[n], original[n]) for n in names)
    assert torch.equal(read["lm_head.weight"], original["backbone.embedding.weight"])  # tied: the head is the embedding
