"""The base class of every refusal a user can act on, the one layout error, and the base of the warnings
a run's console shows as its own lines.

A refusal's message says what is wrong (the offending value and the rule) and how to fix it;
entry points print it as one line and exit non-zero. Anything that is not a `MegamambaError`
is a bug, not a refusal.
"""


class MegamambaError(Exception):
    """Input (config, flags, data, tokenizer, checkpoint, layout) that cannot be used as it is."""


class LayoutError(MegamambaError, ValueError):
    """A model, parallel layout, DeepSpeed config and flags that cannot run together; the message
    names the values and the rule they break."""


class MegamambaWarning(UserWarning):
    """Something the user should know that does not stop the run (a damaged checkpoint passed over, changed
    optimizer settings); train.py's console shows it as one `train.py: warning:` line."""
