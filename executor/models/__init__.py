"""Model definitions."""

from .qwen4_exp import Qwen4ExpForCausalLM

__all__ = ["Qwen4ExpForCausalLM"]
