"""`python -m megamamba.generate` refuses weights holding a NaN or an infinity: one line naming the first such
tensor, exit status 2, no text (without the check, sampling crashed and --greedy printed `⁇ ⁇ ⁇`)."""

import pytest
import torch

from megamamba import MambaConfig, MambaLM
from megamamba.checkpoint import model_tensors, save_checkpoint
from megamamba.generate import main as generate_main
from megamamba.tokenizer import load_tokenizer
from resume_runs import snapshot

SSM = {"layer": "Mamba2", "d_state": 6, "headdim": 6, "ngroups": 2, "chunk_size": 8}


def test_a_checkpoint_holding_nan_is_refused_naming_the_tensor(tmp_path, capsys):
    model = MambaLM(MambaConfig(d_model=18, n_layer=2, vocab_size=257, ssm_cfg=SSM))
    with torch.no_grad():
        model.backbone.layers[1].mixer.A_log[4] = float("nan")
    save_checkpoint(str(tmp_path / "save"), 3, model.config, model_tensors(model), tokenizer=load_tokenizer("bytes"))
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        generate_main(["--checkpoint", str(tmp_path / "save"), "--prompt", "Hi", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""
    assert err.splitlines() == [
        f"generate: error: {tmp_path}/save/step_000003/model.safetensors: tensor "
        '"backbone.layers.1.mixer.A_log" holds 1 NaN / inf value (first at index (4,)); the weights are damaged: '
        "load another checkpoint"
    ]
    assert snapshot(tmp_path) == before
