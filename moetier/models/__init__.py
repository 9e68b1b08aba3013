"""Architectures, one file per Hugging Face `model_type`, registered here."""
from __future__ import annotations

import importlib

from ..errors import UserError

# model_type -> module under moetier.models (each defines `Model`)
ARCHS = {
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "olmoe": "olmoe",
    "deepseek_v3": "deepseek_v3",
    "glm4_moe": "glm4_moe",
    "gpt_oss": "gpt_oss",
    "qwen3_next": "qwen3_next",
    "qwen3_5_moe": "qwen3_next",        # Qwen3.5-MoE: the multimodal checkpoint's text model
    "qwen3_5_moe_text": "qwen3_next",
}


def model_class(model_type: str):
    if model_type not in ARCHS:
        raise UserError(f"unsupported model_type {model_type!r}; moetier supports: {', '.join(sorted(ARCHS))}")
    return importlib.import_module(f".{ARCHS[model_type]}", __name__).Model
