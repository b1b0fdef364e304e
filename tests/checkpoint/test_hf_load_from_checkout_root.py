"""transformers loads our Mamba2 and NemotronH exports in a process started in the checkout's root
(`python -c`, as a user runs it there), where the root is first on sys.path: nothing of ours found
there may stand in for a package transformers imports (PyPI's `kernels`, for one)."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from checkpoint_fixtures import perturbed_model, tiny
from convert_cli import convert
from megamamba.checkpoint.model_folder import save_model_folder
from megamamba.testing.numerics import relative_error
from megamamba.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]

HYBRID = {
    "n_layer": 3,
    "hybrid_layer_pattern": "M*-",
    "d_intermediate": 22,
    "mlp_activation": "squared_relu",
    "attn_cfg": {
        "num_heads": 6,
        "num_heads_kv": 2,
        "head_dim": 5,
        "causal": True,
        "qkv_proj_bias": False,
        "out_proj_bias": False,
    },
}
LOAD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
ids = torch.tensor(json.loads(sys.argv[1]))
for folder in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        print(json.dumps({"class": type(model).__name__, "logits": model(ids).logits.float().tolist()}))
"""


def test_transformers_loads_our_mamba2_and_nemotron_h_exports_from_the_root(tmp_path):
    ids = torch.randint(0, 37, (1, 9), generator=torch.Generator().manual_seed(0))
    cases = {"Mamba2ForCausalLM": tiny("Mamba2"), "NemotronHForCausalLM": tiny("Mamba2", **HYBRID)}
    models, folders = {}, []
    for hf_class, config in cases.items():
        models[hf_class] = perturbed_model(config, seed=5).eval()
        save_model_folder(models[hf_class], str(tmp_path / hf_class), tokenizer=load_tokenizer("bytes"))
        folders.append(tmp_path / f"{hf_class}_export")
        convert("export", "--checkpoint", tmp_path / hf_class, "--output", folders[-1], "--to", "hf")
    proc = subprocess.run(
        [sys.executable, "-c", LOAD, json.dumps(ids.tolist()), *map(str, folders)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"from {ROOT}:\n{proc.stderr[-3000:]}"
    answers = [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(folders) :]]
    assert [a["class"] for a in answers] == list(cases)
    for answer, (hf_class, model) in zip(answers, models.items()):
        vocab = cases[hf_class].vocab_size
        with torch.no_grad():
            ours = model(ids)[..., :vocab]
        assert relative_error(torch.tensor(answer["logits"])[..., :vocab], ours) < 1e-5, hf_class
