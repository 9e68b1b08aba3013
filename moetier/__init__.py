"""moetier: run giant Mixture-of-Experts LLMs on one machine, experts tiered over GPU, RAM and SSD."""
from __future__ import annotations

__version__ = "0.1.0"

from .config import EngineConfig, ModelArgs  # noqa: E402
from .errors import UserError  # noqa: E402
from .runtime.sampling import SamplingParams  # noqa: E402


def load(model=None, **config) -> "Engine":
    """Load a model directory (or the embedded default when `model` is None) into an Engine.
    Keyword arguments are EngineConfig fields (device, dtype, max_context, ...)."""
    from .runtime.engine import Engine
    return Engine.load(model, EngineConfig(**config))


def generate(prompt: str, model=None, max_tokens: int = 128, **sampling) -> str:
    """One-shot convenience: the generated text for `prompt`."""
    return load(model, progress=False).complete(prompt, max_tokens=max_tokens,
                                                params=SamplingParams(**sampling)).text


def __getattr__(name):
    if name == "Engine":
        from .runtime.engine import Engine
        return Engine
    raise AttributeError(name)
