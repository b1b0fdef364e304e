"""Train a Mamba LM in one process with plain PyTorch: the readable baseline, no DeepSpeed.

    python launch/train_single.py --model-config launch/models/tiny-mamba2.json --train-iters 300

Text is the built-in Python-documentation corpus, byte-level tokenized. Each step's batch is
drawn from a generator seeded by (seed, step), so a run is reproducible and any step's batch
can be recomputed without replaying the ones before it.
"""

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from megamamba import MambaConfig, MambaLM
from megamamba.data.corpus import default_corpus
from megamamba.optim import param_groups
from megamamba.tokenizer.byte_tokenizer import ByteTokenizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-config", default="launch/models/tiny-mamba2.json")
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup-iters", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--metrics-jsonl", default=None, help="append one JSON object per logged step")
    return p.parse_args(argv)


def token_stream(tokenizer) -> torch.Tensor:
    """The corpus as one int64 stream, documents separated by the end-of-document token."""
    ids = []
    for doc in default_corpus():
        ids += tokenizer.encode(doc) + [tokenizer.eod]
    return torch.tensor(ids, dtype=torch.int64)


def batch_at(stream, step, seed, batch_size, seq_length):
    """The (inputs, labels) of `step`: random windows chosen by a generator seeded per step."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - seq_length - 1, (batch_size,), generator=g)
    windows = torch.stack([stream[s : s + seq_length + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def lr_at(step, args):
    """Linear warm-up to --lr, then cosine decay to --min-lr at the last step."""
    if step < args.lr_warmup_iters:
        return args.lr * (step + 1) / args.lr_warmup_iters
    progress = (step - args.lr_warmup_iters) / max(1, args.train_iters - args.lr_warmup_iters)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    tokenizer = ByteTokenizer()
    config = MambaConfig.from_json(args.model_config)
    if config.vocab_size != tokenizer.vocab_size:
        raise SystemExit(
            f"--model-config has vocab_size={config.vocab_size} but the byte tokenizer has "
            f"{tokenizer.vocab_size} tokens: set vocab_size to {tokenizer.vocab_size}"
        )
    model = MambaLM(config)
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    stream = token_stream(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, corpus: {stream.numel() / 1e6:.2f}M tokens", flush=True)
    metrics = open(args.metrics_jsonl, "a") if args.metrics_jsonl else None
    t0 = time.perf_counter()
    for step in range(args.train_iters):
        inputs, labels = batch_at(stream, step, args.seed, args.micro_batch_size, args.seq_length)
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        logits = model(inputs)[..., : config.vocab_size]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()
        if step % args.log_interval == 0 or step == args.train_iters - 1:
            elapsed = time.perf_counter() - t0
            record = {
                "step": step,
                "loss": loss.item(),
                "lr": lr,
                "grad_norm": grad_norm.item(),
                "tokens_per_s": (step + 1) * inputs.numel() / elapsed,
            }
            print(
                " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()),
                flush=True,
            )
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
    if metrics:
        metrics.close()


if __name__ == "__main__":
    main()
