"""megamamba: pretrain Mamba-1 / Mamba-2 language models.

`from megamamba import MambaConfig, MambaLM` gives the config (mamba_ssm's config.json form)
and the plain single-device model; nothing here imports DeepSpeed.
"""

from megamamba.config import MambaConfig
from megamamba.model.lm import MambaLM

__all__ = ["MambaConfig", "MambaLM"]
