"""Train a SentencePiece tokenizer on text, folders of .txt or JSONL files.

    python -m megamamba.tokenizer.train --input corpus.jsonl --vocab-size 4096 --output-prefix data/spm

writes data/spm.model (load it with `--tokenizer data/spm.model`). Same input and options, same file.
An existing data/spm.model is refused, left as it is, unless --overwrite is given.
"""

import argparse
import sys

from megamamba.data.documents import input_files, iter_documents
from megamamba.data.existing_outputs import OutputExistsError, refuse_existing
from megamamba.tokenizer.sentencepiece_model import MODEL_TYPES, TRAIN_THREADS, model_path, train_sentencepiece


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="text files (one document each), folders, .jsonl files")
    p.add_argument("--json-key", default="text", help="the text's key in JSONL records")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-type", default="bpe", choices=MODEL_TYPES)
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.model")
    p.add_argument("--overwrite", action="store_true", help="replace <prefix>.model if it exists (else: refused)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=TRAIN_THREADS, help="part of the result: keep it to reproduce a model"
    )
    p.add_argument("--max-sentences", type=int, default=0, help="train on a seeded sample of this many lines (0: all)")
    p.add_argument(
        "--replace-invalid-utf8",
        action="store_true",
        help="replace invalid UTF-8 with U+FFFD, saying where, instead of refusing the input",
    )
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        if not args.overwrite:
            refuse_existing("--output-prefix", args.output_prefix, [model_path(args.output_prefix)])
        docs = (text for text, _ in iter_documents(input_files(args.input), args.json_key, args.replace_invalid_utf8))
        path = train_sentencepiece(
            docs,
            args.output_prefix,
            args.vocab_size,
            args.model_type,
            seed=args.seed,
            threads=args.threads,
            max_sentences=args.max_sentences,
        )
    except (OSError, ValueError, OutputExistsError) as e:
        print(f"tokenizer.train: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
