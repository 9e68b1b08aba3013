"""GGML quantization formats: registry and torch dequant (formats), packing (pack), lossless
kernel-friendly repacking (repack). Implementations: legacy.py (F32/F16/BF16, Q4_0..Q8_0),
kquants.py (Q2_K..Q6_K), iquants.py (MXFP4, IQ4_NL/XS, IQ3_S/XXS, IQ2_S/XS/XXS)."""
from .formats import BY_ID, FORMATS, QuantFormat, dequantize, get_format
from .pack import quantize
from .repack import REPACKED, dequantize_repacked, repack

__all__ = [
           "BY_ID",
           "FORMATS",
           "REPACKED",
           "QuantFormat",
           "dequantize",
           "dequantize_repacked",
           "get_format",
           "quantize",
           "repack",
]
