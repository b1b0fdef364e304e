"""Start-up refusals of train.py that used to be tracebacks or silent: one line, exit status 2, before
training. Data made with another tokenizer is refused by name and trains with the override flag."""

import io
import json

import pytest

from megamamba.data.preprocess import preprocess
from megamamba.tokenizer import train_sentencepiece
from resume_runs import errors

pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog. def main(): return 0\n"


def refused(resume_runs, argv) -> str:
    out = resume_runs.new_dir()
    run = resume_runs.direct(argv(out), out=out)
    assert run["returncode"] == 2, run["stderr"][-3000:]
    assert "Traceback" not in run["stderr"] and "| loss " not in run["stdout"]
    (line,) = errors(run["stderr"])
    return line


@pytest.mark.parametrize("block", ["zero_optimization", "bf16"])
def test_a_null_block_in_the_deepspeed_config_is_one_line(resume_runs, tmp_path, block):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, block: None}))

    def argv(out):
        args = resume_runs.argv(out, zero=0)
        args[args.index("--deepspeed_config") + 1] = str(config)
        return args

    line = refused(resume_runs, argv)
    assert (
        line == f"train.py: error: --deepspeed_config '{config}': \"{block}\" is null; it must be an object "
        '(e.g. {"stage": 1} for zero_optimization), or leave the key out'
    )


def test_a_loss_spike_factor_not_above_1_is_one_line(resume_runs):
    line = refused(resume_runs, lambda out: resume_runs.argv(out, zero=0, flags=["--loss-spike-factor", "1"]))
    assert line.startswith("train.py: error: --loss-spike-factor 1.0: must be > 1")


@pytest.fixture(scope="module")
def bytes_data_and_spm(tmp_path_factory):
    """A dataset made with the bytes tokenizer, and a 330-id SentencePiece model."""
    root = tmp_path_factory.mktemp("tokenizer_mismatch")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{i} {TEXT * 3}"}) + "\n" for i in range(60)))
    (prefix,) = preprocess([str(corpus)], "bytes", str(root / "data"), progress_stream=io.StringIO())
    spm = train_sentencepiece([f"{i} {TEXT} ünïcödé ☃ 漢字" for i in range(200)], str(root / "spm"), 330)
    return prefix, spm


def mismatch_argv(resume_runs, out, prefix, spm, flags=()):
    args = resume_runs.argv(out, zero=0, flags=["--data", prefix, "--tokenizer", spm, "--train-iters", "1", *flags])
    args[args.index("--model-config") + 1] = resume_runs.model_config(vocab_size=336)
    return args


def test_data_made_with_another_tokenizer_is_refused_by_name(resume_runs, bytes_data_and_spm):
    prefix, spm = bytes_data_and_spm
    line = refused(resume_runs, lambda out: mismatch_argv(resume_runs, out, prefix, spm))
    assert f"{prefix}: made with tokenizer 'bytes' (bytes, 257 ids), but --tokenizer is '{spm}'" in line
    assert "--allow-tokenizer-mismatch" in line


def test_the_tokenizer_mismatch_trains_with_the_override_and_a_warning(resume_runs, bytes_data_and_spm):
    prefix, spm = bytes_data_and_spm
    out = resume_runs.new_dir()
    run = resume_runs.direct(mismatch_argv(resume_runs, out, prefix, spm, ["--allow-tokenizer-mismatch"]), out=out)
    assert run["returncode"] == 0, run["stderr"][-3000:]
    assert f"train.py: warning: {prefix}: made with tokenizer 'bytes'" in run["stdout"]
    assert "training on it anyway (--allow-tokenizer-mismatch)" in run["stdout"]
    assert [r["step"] for r in run["records"]] == [0]
