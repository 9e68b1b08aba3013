"""llama.cpp's file types (`llama-quantize`'s Q4_K_M, IQ3_XXS, ...): which GGML type each tensor is stored in.

A file type names a default type and a mix: llama.cpp stores the tensors that hurt most when squeezed (attn_v, the
first and last layers' ffn_down, the output head) in more bits. `Mix.tensor_type` follows llama-quant.cpp's
`llama_tensor_get_type` (as of llama.cpp 2026-10) for the architectures moetier loads; the Falcon and 70B-Llama
special cases do not apply and are left out. Which tensors need an importance matrix follows its
`tensor_requires_imatrix`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# file type -> (llama_ftype id written to general.file_type, default GGML type)
FILE_TYPES = {
    "F32": (0, "F32"), "F16": (1, "F16"), "BF16": (32, "BF16"),
    "Q4_0": (2, "Q4_0"), "Q4_1": (3, "Q4_1"), "Q5_0": (8, "Q5_0"), "Q5_1": (9, "Q5_1"), "Q8_0": (7, "Q8_0"),
    "Q2_K": (10, "Q2_K"), "Q2_K_S": (21, "Q2_K"), "Q3_K_S": (11, "Q3_K"), "Q3_K_M": (12, "Q3_K"),
    "Q3_K_L": (13, "Q3_K"), "Q4_K_S": (14, "Q4_K"), "Q4_K_M": (15, "Q4_K"), "Q5_K_S": (16, "Q5_K"),
    "Q5_K_M": (17, "Q5_K"), "Q6_K": (18, "Q6_K"),
    "IQ1_S": (24, "IQ1_S"), "IQ1_M": (31, "IQ1_M"), "IQ2_XXS": (19, "IQ2_XXS"), "IQ2_XS": (20, "IQ2_XS"),
    "IQ2_S": (28, "IQ2_XS"), "IQ2_M": (29, "IQ2_S"), "IQ3_XXS": (23, "IQ3_XXS"), "IQ3_XS": (22, "IQ3_S"),
    "IQ3_S": (26, "IQ3_S"), "IQ3_M": (27, "IQ3_S"), "IQ4_NL": (25, "IQ4_NL"), "IQ4_XS": (30, "IQ4_XS"),
    "MXFP4_MOE": (38, "MXFP4"),
}
# a type on rows its block does not divide -> llama.cpp's fallback (then F16 if that fails too)
FALLBACK = {"IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL",
            "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0",
            "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# tensors kept as the source has them (float32 here): norms, routers, biases, sinks (llama.cpp's
# tensor_allows_quantization for the architectures moetier loads)
KEEP = ("_norm.weight", "ffn_gate_inp.", "exp_probs_b", "attn_sinks", "ssm_conv1d", "ffn_gate_tid2eid")
LOW_IQ = {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M"}      # llama.cpp's 1-2 bit i-quant file types
NEEDS_IMATRIX = {"IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S"}


def use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
                     ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                     ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if key in name:
            return "attn_qkv" if key == "attn_qkv.weight" else cat
    return "other"


def _layer(name: str) -> int | None:
    m = re.match(r"^blk\.(\d+)\.", name)
    return int(m[1]) if m else None


@dataclass
class Mix:
    """The storage types of one file: `ftype` (a FILE_TYPES key), the model's block / expert / GQA counts, the
    names of every tensor (in any order: attn_v's rank counts by layer) and whether an importance matrix is given."""
    ftype: str
    n_layer: int
    n_expert: int = 0
    n_gqa: int = 1
    names: list[str] = field(default_factory=list)
    has_imatrix: bool = False

    def __post_init__(self):
        self.tied = "output.weight" not in self.names
        wv = sorted({n for n in self.names if category(n) in ("attn_v", "attn_qkv")}, key=lambda n: (_layer(n) or 0, n))
        self.wv_rank = {n: i for i, n in enumerate(wv)}
        self.n_wv = len(wv)
        down = sorted({n for n in self.names if category(n) == "ffn_down"}, key=lambda n: (_layer(n) or 0, n))
        self.down_rank = {n: i for i, n in enumerate(down)}

    def tensor_type(self, name: str, shape: tuple, pure: bool = False) -> str:
        """GGML type name of tensor `name` ([..., K] torch shape; experts [E, rows, K]); `pure`: the file type's
        default type wherever llama.cpp quantizes (llama-quantize --pure)."""
        if len(shape) < 2 or not name.endswith("weight") or any(k in name for k in KEEP):
            return "F32"
        t = FILE_TYPES[self.ftype][1]
        if t in ("F32", "F16", "BF16"):
            return t
        return self._fallback(t if pure else self._mixed(name, shape, t), shape[-1])

    def requires_imatrix(self, name: str, qtype: str) -> bool:
        if name in ("token_embd.weight", "output.weight"):
            return False
        return qtype in NEEDS_IMATRIX or (qtype == "Q2_K" and self.ftype == "Q2_K_S")

    @staticmethod
    def _fallback(t: str, cols: int) -> str:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        block = (lambda q: GGML_QUANT_SIZES[GGMLQuantizationType[q]][0])
        if cols % block(t):
            t = FALLBACK.get(t, t)
            if cols % block(t):
                t = "F16"
        return t

    def _mixed(self, name: str, shape: tuple, t: str) -> str:   # llama_tensor_get_type_impl
        f, cat, ne = self.ftype, category(name), self.n_expert
        layer = _layer(name)
        if cat == "output" or (self.tied and cat == "token_embd"):
            from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
            if f == "MXFP4_MOE" or shape[-1] % GGML_QUANT_SIZES[GGMLQuantizationType[t]][0]:
                return "Q8_0"
            if f in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"):
                return "Q5_K"
            return t if t == "Q8_0" else "Q6_K"
        if f == "MXFP4_MOE":
            return "MXFP4" if len(shape) == 3 and shape[0] > 1 else "Q8_0"
        if cat == "token_embd":
            if f in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
                return "Q2_K"
            return "IQ3_S" if f in ("IQ2_S", "IQ2_M", "IQ3_XXS") else t
        if f in LOW_IQ:
            if cat in ("attn_v", "attn_qkv"):
                if self.n_gqa >= 4 or ne >= 4:
                    return "Q4_K"
                return "IQ3_S" if f in ("IQ2_S", "IQ2_M") else "Q2_K"
            if ne == 8 and cat == "attn_k":
                return "Q4_K"
            if cat == "ffn_down":                     # a count of ffn_down tensors here, not the layer
                if self.down_rank.get(name, 0) < self.n_layer // 8:
                    return "IQ3_S" if f in ("IQ2_S", "IQ2_M") else "Q2_K"
                return t
            if cat == "attn_output":
                if ne == 8:
                    return "Q5_K"
                if f in ("IQ1_S", "IQ1_M"):
                    return "IQ2_XXS"
                return "IQ3_S" if f in ("IQ2_S", "IQ2_M") else t
            return t
        if cat in ("attn_v", "attn_qkv"):            # llama.cpp's later attn_qkv branch is never reached
            return self._attn_v(name, t)
        if cat == "attn_k":
            if ne == 8:
                return "Q8_0"
            return {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(f, t)
        if cat == "attn_q":
            return {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(f, t)
        if cat == "ffn_down":
            return self._ffn_down(layer if layer is not None else 0, t)
        if cat == "attn_output":
            if ne == 8:
                eight = {"Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S",
                         "IQ3_M", "IQ4_XS"}
                return "Q5_K" if f in eight else t
            return {"Q2_K": "Q3_K", "IQ3_XXS": "IQ3_S", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K", "IQ3_M": "Q4_K"}.get(f, t)
        if cat in ("ffn_gate", "ffn_up") and f == "IQ3_XS" and layer is not None \
                and self.n_layer // 8 <= layer < 7 * self.n_layer // 8:
            return "IQ3_XXS"
        return t

    def _attn_v(self, name: str, t: str) -> str:
        f, gqa, i = self.ftype, self.n_gqa, self.wv_rank.get(name, 0)
        if f == "Q2_K":
            t = "Q4_K" if gqa >= 4 else "Q3_K"
        elif f == "Q2_K_S" and gqa >= 4:
            t = "Q4_K"
        elif f == "IQ3_XXS":
            t = "Q4_K" if gqa >= 4 else ("IQ3_XXS" if self.has_imatrix else "IQ3_S")
        elif f in ("IQ3_XS", "IQ3_S") and gqa >= 4:
            t = "Q4_K"
        elif f == "IQ3_M":
            t = "Q4_K"
        elif f == "Q3_K_M":
            t = "Q5_K" if i < 2 else "Q4_K"
        elif f == "Q3_K_L":
            t = "Q5_K"
        elif f in ("IQ4_NL", "IQ4_XS") and gqa >= 4:
            t = "Q5_K"
        elif f in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, self.n_wv):
            t = "Q6_K"
        elif f == "Q4_K_S" and i < 4:
            t = "Q5_K"
        return "Q8_0" if self.n_expert == 8 else t

    def _ffn_down(self, i: int, t: str) -> str:
        f, n = self.ftype, self.n_layer
        if f == "Q2_K":
            return "Q3_K"
        if f == "Q2_K_S":
            return "Q4_K" if i < n // 8 else t
        if f == "IQ3_XXS" and not self.has_imatrix:
            return "Q4_K" if i < n // 8 else "Q3_K"
        if f == "Q3_K_M":
            return "Q5_K" if i < n // 16 else "Q4_K"
        if f == "IQ3_M" and (i < n // 8 or (self.n_expert == 8 and use_more_bits(i, n))):
            return "Q4_K"
        if f == "Q3_K_L":
            return "Q5_K"
        if f == "Q4_K_M":
            return "Q6_K" if use_more_bits(i, n) else t
        if i < n // 8 and f in ("IQ4_NL", "IQ4_XS") and not self.has_imatrix:
            return "Q5_K"
        if f == "Q5_K_M" and use_more_bits(i, n):
            return "Q6_K"
        if f == "Q4_K_S" and i < n // 8:
            return "Q5_K"
        if f in ("Q4_0", "Q5_0") and self.has_imatrix and i < n // 8:
            return "Q4_1" if f == "Q4_0" else "Q5_1"
        return t
