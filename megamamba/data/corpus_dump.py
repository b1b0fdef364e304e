"""Write the built-in corpus (megamamba.data.corpus.default_corpus) as JSONL, one {"text": ...} per document.

    python -m megamamba.data.corpus_dump --output data/python_docs.jsonl [--include-sources]

so the default corpus goes through the same tokenizer training and preprocessing as any user data.
"""

import argparse
import json
import os
import sys

from megamamba.data.corpus import default_corpus


def dump(path: str, include_sources: bool = False) -> int:
    """Write the corpus; returns the number of documents."""
    docs = default_corpus(include_sources=include_sources)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    return len(docs)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True, help="the JSONL file to write")
    p.add_argument("--include-sources", action="store_true", help="add the standard library's sources (~12 MB)")
    args = p.parse_args(argv)
    count = dump(args.output, args.include_sources)
    print(f"wrote {count} documents to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
