"""A default training corpus that needs no download: text every Python installation carries.

Documents come in a fixed order (the documentation topics of `pydoc_data`, sorted by name, then
optionally the standard library's sources sorted by path), so the same Python version always
yields the same corpus. Users train on their own data; this serves the quickstart and tests.
"""

import os
import pydoc_data.topics
import sysconfig

_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


def python_docs() -> list[str]:
    """The Python documentation topics (about 0.5 MB of English prose and examples)."""
    topics = pydoc_data.topics.topics
    return [topics[name] for name in sorted(topics)]


def python_sources() -> list[str]:
    """The standard library's Python sources (about 12 MB), test suites excluded."""
    stdlib = sysconfig.get_paths()["stdlib"]
    paths = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        paths += [os.path.join(root, f) for f in files if f.endswith(".py")]
    docs = []
    for path in sorted(paths, key=lambda p: os.path.relpath(p, stdlib)):
        with open(path, encoding="utf-8", errors="replace") as f:
            docs.append(f.read())
    return docs


def default_corpus(include_sources: bool = False) -> list[str]:
    """Documentation topics, then (if asked) the standard library's sources."""
    return python_docs() + (python_sources() if include_sources else [])
