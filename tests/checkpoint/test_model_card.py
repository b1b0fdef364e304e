"""A transformers export carries a README.md: the class and layer pattern, the tokens its checkpoint was trained
on, and how to load, serve and evaluate it."""

import math

import torch
from safetensors import safe_open

from checkpoint_fixtures import perturbed_model, tiny
from convert_cli import convert
from megamamba.checkpoint import save_training_checkpoint
from megamamba.checkpoint.model_folder import save_model_folder
from megamamba.tokenizer import load_tokenizer

STREAM = {
    "consumed_samples": 96,
    "global_batch_size": 8,
    "seq_length": 64,
    "seed": 1234,
    "reset_at_documents": False,
    "tokenizer": {"name": "bytes", "identity": "bytes", "vocab_size": 257},
    "data": [],
}


def test_the_card_of_a_checkpoint_says_what_it_is_and_the_tokens_it_was_trained_on(tmp_path):
    model = perturbed_model(tiny("Mamba2", vocab_size=257), 3)
    save = str(tmp_path / "save")
    save_training_checkpoint(
        save,
        12,
        model,
        torch.optim.AdamW(model.parameters()),
        extra={"stream": STREAM},
        tokenizer=load_tokenizer("bytes"),
    )
    convert("export", "--checkpoint", save, "--output", tmp_path / "hf")
    card = (tmp_path / "hf" / "README.md").read_text()
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        parameters = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # real vocabulary rows
    assert card.startswith("# Mamba2ForCausalLM exported by megamamba\n")
    assert f"- {parameters:,} parameters; d_model 18, 2 blocks (mamba), vocabulary 257" in card
    assert "- layer pattern: `MM` (M Mamba (Mamba2)" in card
    assert "- 6,144 tokens trained (12 steps, sequences of 64 tokens)" in card
    assert "tokenizer: `bytes`" in card
    for usage in (
        "AutoModelForCausalLM.from_pretrained(FOLDER)",
        "LLM(model=FOLDER)",
        "python -m megamamba.evaluate --load CHECKPOINT_DIR --tasks",
    ):
        assert usage in card, usage


def test_the_card_of_a_model_folder_says_its_training_is_not_recorded(tmp_path):
    save_model_folder(
        perturbed_model(tiny("Mamba2", vocab_size=257), 3), str(tmp_path / "m"), tokenizer=load_tokenizer("bytes")
    )
    convert("export", "--checkpoint", tmp_path / "m", "--output", tmp_path / "hf")
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "- exported from a model folder: the training run is not recorded here" in card
