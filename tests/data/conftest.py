"""Fixtures of the data tests; the helpers live in data_fixtures.py."""

from data_fixtures import corpus_jsonl  # noqa: F401  (a fixture)
