"""lm-eval's transformers backend on an export of ours, fed the ids training and generation feed the model.

The exported tokenizer puts the end-of-document token first, as training does. lm-eval's `HFLM`
encodes a rolling-loglikelihood text with the tokenizer's special tokens and then puts its own
prefix token first, so the token would stand there twice; and it drops the leading token from any
text that begins with its spelling (`</s> ...`), which ours encodes as text after the token.
`ExportLM` encodes every context with the leading token exactly once, and a rolling text without
it (lm-eval's prefix is that token). Needs lm-eval (`pip install -e .[eval]`).
"""

import torch
from lm_eval.models.huggingface import HFLM


class ExportLM(HFLM):
    """`HFLM` on a transformers folder written by `megamamba.checkpoint.convert export`."""

    def __init__(self, pretrained: str, **kwargs) -> None:
        self._rolling = False
        super().__init__(pretrained=pretrained, backend="causal", **kwargs)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list:
        self._rolling = True
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        finally:
            self._rolling = False

    def tok_encode(self, string: str, add_special_tokens=None, left_truncate_len=None, **kwargs) -> list:
        """The leading token, unless add_special_tokens=False or a rolling text is being encoded."""
        if add_special_tokens is None:
            add_special_tokens = not self._rolling
        ids = self.tokenizer.encode(string, add_special_tokens=add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_batch_encode(
        self, strings: list, padding_side: str = "left", left_truncate_len=None, truncation: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Generation prompts, each after the leading token, padded on `padding_side`."""
        encoding = self.tokenizer(
            strings,
            add_special_tokens=True,
            padding="longest",
            padding_side=padding_side,
            truncation=truncation,
            return_tensors="pt",
        )
        ids, mask = encoding["input_ids"], encoding["attention_mask"]
        if left_truncate_len:
            ids, mask = ids[:, -left_truncate_len:], mask[:, -left_truncate_len:]
        return ids, mask
