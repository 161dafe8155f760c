"""mixprec.models: the built-in GPT used by ``mixprec train``, ``diagnose`` and ``bench``."""

from mixprec.models.causal_lm_output import CausalLMOutput
from mixprec.models.gpt import GPT
from mixprec.models.gpt_config import GPT_PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "GPT_PRESETS", "CausalLMOutput"]
