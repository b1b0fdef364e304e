"""A held-out lm-eval task of the tests' own: lm-eval's tasks fetch their datasets from the Hugging Face Hub,
which the tests cannot reach, so the task reads a local JSON-lines file and is scored by lm-eval's rolling
loglikelihood (bits per byte). Pass its folder as `--include-path`; its name is `held_out`."""

import json
from pathlib import Path

TASK = """task: held_out
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
"""


def held_out_task(folder: Path, texts, cache: Path) -> Path:
    """`folder` made, holding the task `held_out` over `texts` (its dataset cached under `cache`)."""
    folder.mkdir()
    (folder / "held_out.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (folder / "held_out.yaml").write_text(TASK.format(data=folder / "held_out.jsonl", cache=cache))
    return folder
