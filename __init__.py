"""tidal: an OpenAI-compatible serving engine for Qwen4-Exp hybrid MoE models."""

__version__ = "0.1.0"


def __getattr__(name):
    # Imported lazily so that light processes (frontend, detokenizer, tap) never import torch.
    if name == "LLM":
        from .llm import LLM

        return LLM
    raise AttributeError(name)
