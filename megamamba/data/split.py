"""Megatron's `--split`: train, validation and test parts carved from one `--data` blend by document ranges.

    --split 969,30,1    of every dataset of the blend, the first 969/1000 of its documents train,
                        the next 30/1000 validate and the last 1/1000 are the test part

Proportions are normalised (`90,10` is train 0.9, validation 0.1, no test). The parts are
contiguous ranges of document numbers with boundaries round(n * cumulative proportion), so they
are disjoint, cover every document, and depend only on the dataset and the proportions. Each
part keeps the blend's weights. Nothing consumes the test part yet: it is only kept out of the
other two.
"""

import math
from fractions import Fraction
from typing import NamedTuple, Optional, Sequence

PARTS = ("train", "validation", "test")
EXAMPLE = "e.g. --split 969,30,1 for train, validation and test"


def parse_split(text: str) -> tuple[Fraction, Fraction, Fraction]:
    """ "969,30,1" -> normalised (train, validation, test) proportions; missing trailing parts are 0."""
    values = text.split(",")
    if len(values) > len(PARTS):
        raise ValueError(f"--split {text!r}: {len(values)} proportions; at most {len(PARTS)} ({EXAMPLE})")
    proportions = []
    for value in values:
        try:
            proportion = Fraction(value.strip())
        except ValueError:
            raise ValueError(f"--split {text!r}: {value!r} is not a number ({EXAMPLE})") from None
        if proportion < 0:
            raise ValueError(f"--split {text!r}: proportion {value!r} is negative ({EXAMPLE})")
        proportions.append(proportion)
    total = sum(proportions)
    if proportions[0] == 0:
        raise ValueError(f"--split {text!r}: the training part is empty ({EXAMPLE})")
    proportions += [Fraction(0)] * (len(PARTS) - len(proportions))
    return tuple(p / total for p in proportions)


def document_ranges(num_documents: int, proportions: Sequence[Fraction]) -> list[tuple[int, int]]:
    """[first, stop) document numbers of each part: boundaries at round(n * cumulative proportion), half up."""
    bounds, cumulative = [0], Fraction(0)
    for proportion in proportions:
        cumulative += proportion
        bounds.append(math.floor(num_documents * cumulative + Fraction(1, 2)))
    return list(zip(bounds[:-1], bounds[1:]))


class DocumentRange:
    """Documents [first, stop) of a dataset, read as the packer reads a whole dataset (its tokens, a slice of
    its offsets)."""

    def __init__(self, dataset, first: int, stop: int, part: str):
        self.source, self.first, self.stop = dataset, first, stop
        self.prefix = f"{dataset.prefix} ({part} part of --split: documents {first}..{stop - 1})"
        self.tokens = dataset.tokens
        self.offsets = dataset.offsets[first : stop + 1]
        self.num_tokens = int(self.offsets[-1] - self.offsets[0])

    @property
    def num_documents(self) -> int:
        return self.offsets.size - 1

    def locate(self, position: int) -> str:
        """Where `tokens[position]` is (the tokens are the whole dataset's), for messages."""
        return self.source.locate(position)


class SplitBlend(NamedTuple):
    train: list
    valid: Optional[list]  # None when the validation proportion is 0
    test: Optional[list]  # None when the test proportion is 0


def split_blend(datasets: Sequence, text: str) -> SplitBlend:
    """Every dataset of a blend cut into its parts by `--split text`. A training or validation part given a
    proportion but left without documents in some dataset is refused, naming the dataset (an empty test part
    is not: nothing reads it)."""
    proportions = parse_split(text)
    parts = [[] for _ in PARTS]
    for dataset in datasets:
        for part, proportion, (first, stop), out in zip(
            PARTS, proportions, document_ranges(dataset.num_documents, proportions), parts
        ):
            if proportion and first == stop and part != "test":
                raise ValueError(
                    f"--split {text}: the {part} part of {dataset.prefix} ({dataset.num_documents} "
                    f"documents) holds no document; give it a larger proportion or more data"
                )
            out.append(DocumentRange(dataset, first, stop, part))
    return SplitBlend(parts[0], *(part if proportion else None for part, proportion in zip(parts[1:], proportions[1:])))
