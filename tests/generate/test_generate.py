"""Generation: the recurrent step reproduces the parallel forward's argmax; sampling stays in its allowed set."""

import pytest
import torch

from generate_fixtures import HYBRID, train_tiny
from megamamba.generate import allowed_tokens, generate, generate_ids, sample_next

PROMPT = "the cat sat"
NEW = 40


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops: intra-op threads only add overhead, and contention with other test processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(one_thread):
    return train_tiny("Mamba1")


def check_greedy_matches_parallel_argmax(model, tok, losses, layer, new_tokens=NEW):
    assert losses[-1] < 0.5 * losses[0], f"{layer}: the tiny model did not train ({losses[0]:.2f} -> {losses[-1]:.2f})"
    prompt = torch.tensor([[tok.eod] + tok.encode(PROMPT)])
    new = generate_ids(model, prompt, new_tokens, tok.vocab_size, greedy=True)
    with torch.no_grad():
        logits = model(torch.cat([prompt, new[:, :-1]], dim=1))[0, prompt.shape[1] - 1 :, : tok.vocab_size]
    assert torch.isfinite(logits).all()
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    mismatch = (logits.argmax(dim=-1) != new[0]).nonzero().flatten().tolist()
    assert not mismatch, f"{layer}: greedy differs from the parallel argmax at {mismatch} (min margin {margin:.2e})"


def test_greedy_generation_equals_the_parallel_forward_argmax_mamba1(trained):
    check_greedy_matches_parallel_argmax(*trained, "Mamba1")


@pytest.mark.slow
def test_greedy_generation_equals_the_parallel_forward_argmax_mamba2():
    check_greedy_matches_parallel_argmax(*train_tiny("Mamba2"), "Mamba2")


def test_greedy_generation_equals_the_parallel_forward_argmax_hybrid(one_thread):
    """Mamba, attention and MLP layers; 12 prompt and 60 new tokens take the KV cache past its first 64."""
    check_greedy_matches_parallel_argmax(*train_tiny("Mamba2", fields=HYBRID), "hybrid", new_tokens=60)


def test_text_generation_decodes_the_ids_after_an_end_of_document_token(trained):
    model, tok, _ = trained
    text = generate(model, tok, PROMPT, max_new_tokens=12, greedy=True)
    ids = generate_ids(model, torch.tensor([[tok.eod] + tok.encode(PROMPT)]), 12, tok.vocab_size, greedy=True)
    assert text == tok.decode(ids[0].tolist()) and len(text) == 12, repr(text)


def test_seeded_sampling_is_reproducible(trained):
    model, tok, _ = trained
    runs = [generate(model, tok, PROMPT, 12, temperature=1.5, seed=s) for s in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def random_logits(seed, batch=5, vocab=50):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=gen) * 3, gen


def test_top_k_never_samples_outside_the_k_best():
    logits, gen = random_logits(0)
    best = logits.topk(4, dim=-1).indices
    for _ in range(300):
        picked = sample_next(logits, temperature=2.0, top_k=4, generator=gen)
        assert (best == picked[:, None]).any(dim=-1).all(), "top-k sampled a token outside the 4 best"


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.06, 0.04]]))
    assert allowed_tokens(logits, top_p=0.7).tolist() == [[True, True, False, False, False]]
    assert allowed_tokens(logits, top_p=0.76).tolist() == [[True, True, True, False, False]]
    assert allowed_tokens(logits, top_p=0.1).tolist() == [[True, False, False, False, False]]


def test_top_p_never_samples_outside_its_set():
    logits, gen = random_logits(1)
    allowed = allowed_tokens(logits, top_p=0.6)
    assert 0 < allowed.sum() < allowed.numel()
    for _ in range(300):
        picked = sample_next(logits, top_p=0.6, generator=gen)
        assert allowed.gather(-1, picked[:, None]).all(), "top-p sampled a token outside the nucleus"


def test_top_k_and_top_p_combine():
    logits, gen = random_logits(2)
    allowed = allowed_tokens(logits, top_k=3, top_p=0.99)
    assert (allowed.sum(dim=-1) <= 3).all()
    for _ in range(200):
        picked = sample_next(logits, top_k=3, top_p=0.99, generator=gen)
        assert allowed.gather(-1, picked[:, None]).all()


def test_sampling_never_picks_padded_vocabulary_rows(trained):
    model, tok, _ = trained
    assert model.config.padded_vocab_size > tok.vocab_size
    new = generate_ids(
        model,
        torch.tensor([[tok.eod]] * 4),
        25,
        tok.vocab_size,
        temperature=5.0,
        generator=torch.Generator().manual_seed(0),
    )
    assert (new < tok.vocab_size).all()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": 0.0}, "temperature=0.0: must be > 0"),
        ({"top_k": 0}, "top_k=0: must be at least 1"),
        ({"top_p": 1.5}, r"top_p=1.5: must lie in \(0, 1\]"),
    ],
)
def test_bad_sampling_settings_fail_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sample_next(torch.zeros(1, 4), **kwargs)
