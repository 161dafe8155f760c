"""mixprec.models: the built-in GPT used by ``mixprec train``, ``diagnose`` and ``bench``."""

from mixprec.models.gpt import GPT, GPT_PRESETS, CausalLMOutput, GPTConfig

__all__ = ["GPT", "GPTConfig", "GPT_PRESETS", "CausalLMOutput"]
