"""Text generation through the model's recurrent step: greedy, temperature, top-k and top-p sampling.

    python -m megamamba.generate --checkpoint DIR --prompt "def main(" --max-new-tokens 100 --top-p 0.9

The prompt is encoded after the tokenizer's end-of-document token — the token every training
document's segment begins with (see megamamba/data/packing.py) — and run through the model
in parallel once (prefill), which leaves each Mamba layer's conv and SSM state and each
attention layer's keys and values in the inference cache (MLP layers keep nothing); each new
token then costs one `model.step`. DIR is a checkpoint (its manifest's sizes and
checksums verified first), a save directory (the checkpoint its `latest` names) or a plain model
folder (model_folder.py; loaded unverified, with a note). Refusals are one line, exit status 2.
"""

import argparse
import sys
from typing import Optional

import torch

from megamamba.checkpoint import CheckpointError, resolve_model_folder
from megamamba.checkpoint.model_folder import load_model_folder
from megamamba.model.lm import MambaLM
from megamamba.tokenizer import Tokenizer, check_vocab, find_tokenizer, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def allowed_tokens(logits: torch.Tensor, top_k: Optional[int] = None, top_p: Optional[float] = None) -> torch.Tensor:
    """Boolean mask (batch, vocab) of the tokens sampling may pick.

    top_k: the k highest logits (exactly k, ties broken by index). top_p: the smallest set of
    most likely tokens (within the top k) whose probability reaches p; never empty.
    """
    allowed = torch.ones_like(logits, dtype=torch.bool)
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k={top_k}: must be at least 1")
        best = logits.topk(min(top_k, logits.shape[-1]), dim=-1).indices
        allowed = torch.zeros_like(allowed).scatter_(-1, best, True)
    if top_p is not None:
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p}: must lie in (0, 1]")
        probs = torch.softmax(logits.float().masked_fill(~allowed, float("-inf")), dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep = mass_before < top_p
        keep[..., 0] = True
        allowed &= torch.zeros_like(allowed).scatter_(-1, order, keep)
    return allowed


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    greedy: bool = False,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """logits (batch, vocab) -> next ids (batch,) int64."""
    if greedy:
        return logits.argmax(dim=-1)
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: must be > 0 (use greedy decoding for the argmax)")
    scaled = logits.float() / temperature
    scaled = scaled.masked_fill(~allowed_tokens(scaled, top_k, top_p), float("-inf"))
    return torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_ids(
    model: MambaLM,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    greedy: bool = False,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """prompt_ids (batch, prompt_len >= 1) -> new ids (batch, max_new_tokens); ids >= vocab_size are never picked."""
    if prompt_ids.dim() != 2 or prompt_ids.shape[1] < 1:
        raise ValueError(f"prompt_ids shape {tuple(prompt_ids.shape)}: need (batch, length >= 1)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    vocab_size = model.config.vocab_size if vocab_size is None else min(vocab_size, model.config.vocab_size)
    cache = model.allocate_inference_cache(prompt_ids.shape[0])
    logits = model(prompt_ids, inference_cache=cache)[:, -1]
    new = []
    for i in range(max_new_tokens):
        token = sample_next(logits[:, :vocab_size], temperature, top_k, top_p, greedy, generator)
        new.append(token)
        if i + 1 < max_new_tokens:
            logits = model.step(token, cache)
    return torch.stack(new, dim=1) if new else prompt_ids.new_zeros(prompt_ids.shape[0], 0)


def generate(
    model: MambaLM,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int = 100,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    greedy: bool = False,
    seed: Optional[int] = None,
) -> str:
    """The continuation of `prompt` (without the prompt), cut at the first end-of-document token."""
    check_vocab(model.config, tokenizer)
    device = next(model.parameters()).device
    ids = torch.tensor([[tokenizer.eod] + tokenizer.encode(prompt)], device=device)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    new = generate_ids(
        model.eval(), ids, max_new_tokens, tokenizer.vocab_size, temperature, top_k, top_p, greedy, generator
    )[0].tolist()
    if tokenizer.eod in new:
        new = new[: new.index(tokenizer.eod)]
    return tokenizer.decode(new)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--checkpoint",
        required=True,
        help="model folder (config.json + model.safetensors or its shards + tokenizer; every checkpoint "
        "is one), or a --save directory: the checkpoint its `latest` names",
    )
    p.add_argument("--prompt", default="")
    p.add_argument("--tokenizer", default=None, help="tokenizer spec (default: the one saved in the folder)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--greedy", action="store_true", help="always the most likely token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    return p.parse_args(argv)


def check_device(name: str) -> torch.device:
    """The torch device `name` names; ValueError when it is malformed or absent from this machine."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name}: {e}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            built = "torch built without CUDA" if torch.version.cuda is None else "no CUDA device visible"
            raise ValueError(f"--device {name}: CUDA is not available on this machine ({built}); use --device cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return device


def refuse(message) -> None:
    """One line on stderr, exit status 2."""
    print(f"generate: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        device = check_device(args.device)
        folder, verified = resolve_model_folder(args.checkpoint)
    except (CheckpointError, ValueError) as e:
        refuse(e)
    if not verified:
        print(
            f"generate: note: {folder} has no manifest.json: loading it as a plain model folder, without checksums",
            file=sys.stderr,
            flush=True,
        )
    spec = args.tokenizer or find_tokenizer(folder)
    if spec is None:
        refuse(f"{folder} holds no tokenizer files; pass --tokenizer (e.g. bytes or a .model)")
    try:
        tokenizer = load_tokenizer(spec)
        model = load_model_folder(folder, device=device, dtype=DTYPES[args.dtype])
        text = generate(
            model,
            tokenizer,
            args.prompt,
            args.max_new_tokens,
            args.temperature,
            args.top_k,
            args.top_p,
            args.greedy,
            args.seed,
        )
    except (OSError, ValueError) as e:
        refuse(e)
    print(args.prompt + text)


if __name__ == "__main__":
    main()
