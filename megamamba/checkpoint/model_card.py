"""The README.md of a transformers export: what the model is, what it was trained on, and how to load, serve
and evaluate it, so that a folder passed on without its training run still says how to use it."""

import json
import os
from typing import Optional

from megamamba.checkpoint.checkpoint import STATE_FILE
from megamamba.checkpoint.run_record import STREAM
from megamamba.config import MambaConfig

CARD_FILE = "README.md"


def training_facts(folder: str) -> Optional[dict]:
    """The step and tokens trained of the checkpoint in `folder` (its trainer state), None for a model folder."""
    try:
        with open(os.path.join(folder, STATE_FILE)) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    stream = state.get("extra", {}).get(STREAM)
    if not isinstance(stream, dict):
        return {"step": state.get("step")}
    return {
        "step": state.get("step"),
        "tokens": stream["consumed_samples"] * stream["seq_length"],
        "seq_length": stream["seq_length"],
        "tokenizer": stream["tokenizer"]["name"],
    }


def _architecture(config: MambaConfig, hf: dict, parameters: int) -> list:
    kinds = sorted(set(config.block_kinds))
    lines = [
        f"- transformers class: `{hf['architectures'][0]}` (`model_type` {hf['model_type']!r})",
        f"- {parameters:,} parameters; d_model {config.d_model}, {config.n_layer} blocks ({', '.join(kinds)}), "
        f"vocabulary {config.vocab_size}",
        f"- layer pattern: `{config.layer_pattern}` (M Mamba ({config.layer}), * attention, - MLP, E experts)",
    ]
    return lines


def _training(facts: Optional[dict]) -> list:
    if facts is None:
        return ["- exported from a model folder: the training run is not recorded here"]
    if "tokens" not in facts:
        return [f"- checkpoint after {facts['step']} steps; its data stream is not recorded"]
    return [
        f"- {facts['tokens']:,} tokens trained ({facts['step']} steps, sequences of {facts['seq_length']} tokens)",
        f"- tokenizer: `{facts['tokenizer']}`; every document starts after the end-of-document token, which the "
        "exported tokenizer adds as its BOS",
    ]


def model_card(config: MambaConfig, hf: dict, parameters: int, facts: Optional[dict]) -> str:
    """The card of the export whose transformers config is `hf`, of our `config`, trained as `facts` says."""
    nemotron = hf["model_type"] == "nemotron_h"
    lines = [
        f"# {hf['architectures'][0]} exported by megamamba",
        "",
        "## Model",
        *_architecture(config, hf, parameters),
        "",
        "## Training",
        *_training(facts),
        "",
        "## Load it with transformers",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "tok = AutoTokenizer.from_pretrained(FOLDER)",
        "model = AutoModelForCausalLM.from_pretrained(FOLDER)",
        "ids = tok('The quick brown fox', return_tensors='pt').input_ids  # starts with the BOS, as training did",
        "print(tok.decode(model.generate(ids, max_new_tokens=20, do_sample=False)[0]))",
        "```",
        "",
        "## Serve it with vLLM",
        "```python",
        "from vllm import LLM, SamplingParams",
        f"llm = LLM(model=FOLDER{', enable_prefix_caching=False' if nemotron else ''})",
        "print(llm.generate(['The quick brown fox'], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text)",
        "```",
    ]
    if nemotron:
        lines.append(
            "(Prefix caching was reported to break NemotronH on vLLM's CPU backend; it is off here to be safe.)"
        )
    lines += [
        "",
        "## Evaluate it with lm-eval",
        "From the checkpoint, with megamamba (`pip install -e .[eval]`), which scores the ids training fed:",
        "```bash",
        "python -m megamamba.evaluate --load CHECKPOINT_DIR --tasks hellaswag,wikitext",
        "```",
        "Plain `lm_eval --model hf --model_args pretrained=FOLDER` scores `loglikelihood` and `generate_until` "
        "tasks as we do, but counts the BOS twice in `loglikelihood_rolling` (perplexity tasks such as wikitext).",
        "",
    ]
    return "\n".join(lines)
