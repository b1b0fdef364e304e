"""Tokenize text into memory-mapped token datasets (Megatron's .bin/.idx layout).

    python -m megamamba.data.preprocess --input corpus.jsonl --tokenizer data/spm.model \
        --output-prefix data/corpus --workers 4 --valid-fraction 0.02

The files depend only on the input, the tokenizer and the options, never on the worker count.
Existing output files are refused, left as they are, unless --overwrite is given.
Usage: docs/data.md; the held-out rule: its "The data code".
"""

import argparse
import multiprocessing
import sys
from collections import deque
from typing import Iterable, Iterator, Optional

import numpy as np

from megamamba.data.dataset_meta import meta_path, token_range_record, write_meta
from megamamba.data.documents import input_files, iter_documents, total_bytes
from megamamba.data.existing_outputs import OutputExistsError, refuse_existing
from megamamba.data.indexed import DatasetError, IndexedDatasetWriter, token_dtype
from megamamba.data.progress import Progress
from megamamba.tokenizer import load_tokenizer

GOLDEN = 0.6180339887498949
_CHUNK = 32  # documents per task sent to a worker

_worker_tokenizer = None
_worker_dtype = None


def _init_worker(spec: str) -> None:
    global _worker_tokenizer, _worker_dtype
    _worker_tokenizer = load_tokenizer(spec)
    _worker_dtype = token_dtype(_worker_tokenizer.vocab_size)


def _encode(item: tuple[str, int]) -> tuple[Optional[bytes], int]:
    """(text, input bytes) -> (tokens + end-of-document as bytes of the dataset dtype or None if empty, input bytes)."""
    text, nbytes = item
    if not text:
        return None, nbytes
    ids = _worker_tokenizer.encode(text)
    ids.append(_worker_tokenizer.eod)
    return np.asarray(ids, dtype=_worker_dtype).tobytes(), nbytes


def is_validation(document_number: int, valid_fraction: float) -> bool:
    return (document_number * GOLDEN) % 1.0 < valid_fraction


def _encode_chunk(items: list) -> list:
    return [_encode(item) for item in items]


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encoded(items: Iterable, spec: str, workers: int) -> Iterator:
    """Encoded documents in input order. At most 4 chunks per worker are in flight, so the input
    is read only as fast as it is tokenized (Pool.imap would read all of it into memory first)."""
    if workers == 1:
        _init_worker(spec)
        yield from map(_encode, items)
        return
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(spec,)) as pool:
        pending = deque()
        for chunk in _chunks(items, _CHUNK):
            pending.append(pool.apply_async(_encode_chunk, (chunk,)))
            if len(pending) >= 4 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


def _write(
    files, spec, workers, json_key, valid_fraction, writers, progress_stream, replace_invalid_utf8
) -> tuple[int, int]:
    """Tokenize every document into the train (and validation) writer; returns (kept, skipped) counts."""
    dtype = writers[0].dtype
    progress = Progress(total_bytes(files), "preprocess", stream=progress_stream)
    kept = skipped = done = 0
    documents = iter_documents(files, json_key, replace_invalid_utf8)
    for blob, nbytes in _encoded(documents, spec, workers):
        done += nbytes
        if blob is None:
            skipped += 1
        else:
            valid = len(writers) == 2 and is_validation(kept, valid_fraction)
            writers[1 if valid else 0].add_document(np.frombuffer(blob, dtype=dtype))
            kept += 1
        progress.update(done, kept + skipped)
    progress.close()
    return kept, skipped


def dataset_prefixes(output_prefix: str, valid_fraction: float) -> list[str]:
    """The prefixes of the datasets written for `output_prefix`: train first, then validation when split."""
    return [output_prefix + "_train", output_prefix + "_valid"] if valid_fraction > 0 else [output_prefix]


def dataset_files(prefix: str) -> list[str]:
    """The files preprocessing writes for the dataset `prefix`."""
    return [prefix + ".bin", prefix + ".idx", meta_path(prefix)]


def preprocess(
    inputs: list[str],
    tokenizer_spec: str,
    output_prefix: str,
    workers: int = 1,
    json_key: str = "text",
    valid_fraction: float = 0.0,
    progress_stream=sys.stderr,
    replace_invalid_utf8: bool = False,
) -> list[str]:
    """Write the dataset(s) and their tokenizer records; returns their prefixes (train first)."""
    if workers < 1:
        raise ValueError(f"--workers {workers}: must be at least 1")
    if not 0 <= valid_fraction < 1:
        raise ValueError(f"--valid-fraction {valid_fraction}: must lie in [0, 1)")
    files = input_files(inputs)
    tokenizer = load_tokenizer(tokenizer_spec)
    dtype = token_dtype(tokenizer.vocab_size)
    split = valid_fraction > 0
    prefixes = dataset_prefixes(output_prefix, valid_fraction)
    writers = [IndexedDatasetWriter(p, dtype) for p in prefixes]
    try:
        kept, skipped = _write(
            files, tokenizer_spec, workers, json_key, valid_fraction, writers, progress_stream, replace_invalid_utf8
        )
        for prefix, writer in zip(prefixes, writers):
            if not writer.lengths:
                hint = "lower --valid-fraction or " if split else ""
                raise DatasetError(
                    f"{prefix}: no documents ({kept} kept, {skipped} empty skipped, from {len(files)} "
                    f"input files); {hint}give inputs with text"
                )
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    for prefix, writer in zip(prefixes, writers):
        writer.close()
        tokens = token_range_record(writer.low, writer.high, writer.checksum.text())
        write_meta(prefix, tokenizer, tokenizer_spec, tokens)
        writer.commit()
    return prefixes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="text files (one document each), folders, .jsonl files")
    p.add_argument("--json-key", default="text", help="the text's key in JSONL records")
    p.add_argument("--tokenizer", required=True, help='"bytes", a SentencePiece .model, a tokenizer.json or a folder')
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--overwrite", action="store_true", help="replace the output files if they exist (else: refused)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument(
        "--valid-fraction",
        type=float,
        default=0.0,
        help="hold out about this fraction of the documents as <prefix>_valid",
    )
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
            outputs = dataset_prefixes(args.output_prefix, args.valid_fraction)
            refuse_existing("--output-prefix", args.output_prefix, [f for p in outputs for f in dataset_files(p)])
        prefixes = preprocess(
            args.input,
            args.tokenizer,
            args.output_prefix,
            args.workers,
            args.json_key,
            args.valid_fraction,
            replace_invalid_utf8=args.replace_invalid_utf8,
        )
    except (OSError, ValueError, OutputExistsError) as e:
        print(f"preprocess: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    for prefix in prefixes:
        print(f"wrote {prefix}.bin and {prefix}.idx", file=sys.stderr)


if __name__ == "__main__":
    main()
