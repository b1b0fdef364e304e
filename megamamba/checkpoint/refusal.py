"""Why an export format cannot hold a model: the setting that prevents it, and what the format computes instead.

The start-up summary names the settings alone (`setting`), `convert export` the whole reason (`str`).
"""

from typing import NamedTuple


class Refusal(NamedTuple):
    setting: str  # the offending config field(s) and value(s), e.g. "attn_cfg.rotary_emb_dim=16"
    why: str  # what the format has instead, and how to change the setting

    def __str__(self) -> str:
        return f"{self.setting}: {self.why}"


def joined(refusals: list) -> str:
    """Every refusal of one format, in one line."""
    return "; ".join(str(r) for r in refusals)
