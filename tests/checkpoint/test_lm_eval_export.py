"""lm-eval on an export through `ExportLM` scores and generates as our model does.

One export shared by the module: a tiny Mamba-2 with the byte tokenizer and no padding rows (257
embedding rows, the tokenizer's ids), so lm-eval's softmax runs over the vocabulary ours does.
Ours: `MambaLM` on the end-of-document token followed by our ids, as training feeds it. lm-eval
sums float32 log-probabilities, hence equality to 1e-5 nats or 1e-7 of the sum, whichever is
larger. Skipped where lm-eval is not installed (`pip install -e .[eval]`; CI installs it). Slow:
lm-eval's and transformers' imports and the export's load take seconds.
"""

import pytest
import torch

from checkpoint_fixtures import perturbed_model, tiny
from convert_cli import convert
from megamamba.checkpoint.model_folder import save_model_folder
from megamamba.generate import generate
from megamamba.tokenizer import load_tokenizer

pytest.importorskip("lm_eval.models.huggingface", reason="lm-eval is not installed: pip install -e .[eval]")
from lm_eval.api.instance import Instance  # noqa: E402  (after the skip)
from lm_eval.models.huggingface import HFLM  # noqa: E402

from megamamba.lm_eval_model import ExportLM  # noqa: E402

TEXTS = (
    "def f(x):\n    return x + 1\n",
    "naïve café Ωμέγα 日本語",
    "<|endoftext|> and </s>, written out",
)
PAIRS = (
    ("def f(x):", " return"),  # the context's trailing space moves to the continuation
    ("Question: 2 + 2 =", " 4"),
    ("", "an empty context"),  # lm-eval puts its prefix token, our end-of-document token, first
    ("<|endoftext|>literally", " more"),  # HFLM would take the spelling for the token and drop the token
)
PROMPTS = ("def f(x):\n    return", "x = 1", "<|endoftext|> literally")
NEW_TOKENS = 12
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """(our model, our tokenizer, the export's folder)."""
    root = tmp_path_factory.mktemp("lm_eval")
    tok = load_tokenizer("bytes")
    model = perturbed_model(tiny("Mamba2", vocab_size=tok.vocab_size, pad_vocab_size_multiple=1), 5).eval()
    save_model_folder(model, str(root / "model"), tokenizer=tok)
    convert("export", "--checkpoint", root / "model", "--output", root / "hf")
    return model, tok, str(root / "hf")


@pytest.fixture(scope="module")
def lm(export):
    """`ExportLM` on the export, three requests to a batch (generation prompts padded on the left)."""
    return ExportLM(export[2], device="cpu", batch_size=3)


def scored(model, ids: list, first: int) -> float:
    """The sum of log p(ids[i] | ids[:i]) over i >= first, over the real vocabulary as training's loss."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0, :-1, : model.config.vocab_size].double(), dim=-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[first - 1 :].sum().item()


def our_loglikelihood(model, tok, context: str, continuation: str) -> float:
    """log p(continuation | end-of-document token, context), with lm-eval's split of the ids: those of
    context + continuation past the context's own."""
    return scored(model, [tok.eod] + tok.encode(context + continuation), 1 + len(tok.encode(context)))


def close(theirs: float, ours: float) -> bool:
    return abs(theirs - ours) <= max(1e-5, 1e-7 * abs(ours))


def requests(kind: str, args: list) -> list:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_rolling_loglikelihood_is_ours_with_the_end_of_document_token_once(export, lm):
    model, tok, _ = export
    theirs = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in TEXTS]))
    ours = [our_loglikelihood(model, tok, "", t) for t in TEXTS]
    assert all(close(a, b) for a, b in zip(theirs, ours)), (theirs, ours)


def test_loglikelihood_of_a_continuation_is_ours(export, lm):
    model, tok, _ = export
    theirs = [score for score, _ in lm.loglikelihood(requests("loglikelihood", list(PAIRS)))]
    ours = [our_loglikelihood(model, tok, *pair) for pair in PAIRS]
    assert all(close(a, b) for a, b in zip(theirs, ours)), (theirs, ours)


def test_greedy_generate_until_is_megamamba_generate(export, lm):
    model, tok, _ = export
    options = {"until": [], "max_gen_toks": NEW_TOKENS, "do_sample": False}
    theirs = lm.generate_until(requests("generate_until", [(p, options) for p in PROMPTS]))
    assert theirs == [generate(model, tok, p, NEW_TOKENS, greedy=True) for p in PROMPTS]


def test_lm_eval_s_own_transformers_backend_puts_the_end_of_document_token_in_twice(export):
    """What `ExportLM` is for: HFLM puts its prefix token before the tokenizer's leading token and scores
    the second after the first."""
    model, tok, folder = export
    plain = HFLM(pretrained=folder, backend="causal", device="cpu")
    theirs = plain.loglikelihood_rolling(requests("loglikelihood_rolling", [(TEXTS[0],)]))[0]
    assert close(theirs, scored(model, [tok.eod, tok.eod] + tok.encode(TEXTS[0]), 1))
    assert not close(theirs, our_loglikelihood(model, tok, "", TEXTS[0]))
