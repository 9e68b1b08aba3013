"""Weight arenas as Triton kernel arguments: the repack planes of each format mapped to the kernels'
plane slots, checked, with word views for the v2 decode kernels (triton_decode.py).

Q4_K / Q5_K store dmin beside d (one d plane) and a 64-chunk's mins beside its scales (one sc plane): the
slots dmin and mn are views of those planes from element 1 and 2 (dmin of super-block b at 2b, the mins of
chunk c at 4c, 4c + 1; d at 2b and the scales at 4c, 4c + 1 in their own slots). The v2 kernels get the two
as int32 words instead: d's word b = (d, dmin) (fp16 bits, low half first), sc's word c = sc_lo, sc_hi,
mn_lo, mn_hi (bytes 0-3), in the d / dmin and sc / mn slots alike. Q2_K's d plane holds (d, dmin) pairs too and
its sc bytes a scale (low nibble) and a min (high) each: its v2 kernels read d and sc as words (d's word b = (d,
dmin), sc's word i = the 4 bytes of sub-blocks 4i .. 4i + 3); the element gathers read dmin at 2b + 1 of d.
"""
from __future__ import annotations

import torch

FMT_CODES = {"dense": 0, "Q8_0": 1, "Q4_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5, "MXFP4": 6, "IQ3_XXS": 7,
             "IQ2_XXS": 8, "Q2_K": 9, "Q3_K": 10}
# GGML formats read as stored (triton_rawq: one "raw" plane of the file's rows): (code, block, bytes a block); codes
# from triton_rawq.FIRST_RAW
RAW_FORMATS = {"IQ4_XS": (11, 256, 136), "IQ2_XS": (12, 256, 74), "IQ2_S": (13, 256, 82), "IQ3_S": (14, 256, 110),
               "IQ1_S": (15, 256, 50), "IQ1_M": (16, 256, 56)}
FMT_CODES.update({f: code for f, (code, _, _) in RAW_FORMATS.items()})
BLOCK = {"dense": 1, "Q8_0": 32, "Q4_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "MXFP4": 32,   # row lengths:
         "IQ3_XXS": 256, "IQ2_XXS": 256, "Q2_K": 256, "Q3_K": 256,                             # multiples
         **{f: block for f, (_, block, _) in RAW_FORMATS.items()}}

# per format: plane -> elements of a row per entry of the plane's last dim (its length is K / that)
PLANE_DIV = {"dense": {"w": 1}, "Q8_0": {"qs": 1, "d": 32}, "Q4_0": {"qs": 2, "d": 32},
             "Q4_K": {"qs": 2, "d": 128, "sc": 16}, "Q5_K": {"qs": 2, "d": 128, "sc": 16, "qh": 8},
             "Q6_K": {"ql": 2, "qh": 4, "sc": 16, "d": 256}, "MXFP4": {"qs": 2, "e": 32},
             "IQ3_XXS": {"qs": 4, "sg": 32, "sc": 32, "d": 256},
             "IQ2_XXS": {"qs": 8, "sg": 32, "sc": 32, "d": 256},
             "Q2_K": {"qs": 4, "sc": 16, "d": 128}, "Q3_K": {"qs": 4, "hm": 8, "sc": 16, "d": 256}}
SLOTS = ("q", "d", "dmin", "sc", "mn", "h")            # kernel plane arguments, in order
SLOT_OF = {"w": "q", "qs": "q", "ql": "q", "e": "d", "qh": "h", "sg": "h", "hm": "h"}   # plane name -> slot
WORD_SLOTS = ("q", "h")                                  # read as int32 words by the v2 kernels
K_PAIRS = {"dmin": ("d", 1), "mn": ("sc", 2)}            # Q4_K / Q5_K: slot -> (plane, first element) (module doc)
K_WORDS = {"d": "d", "dmin": "d", "sc": "sc", "mn": "sc"}   # Q4_K / Q5_K: v2 slot -> plane read as int32 words
V2_WORDS = {"Q4_K": K_WORDS, "Q5_K": K_WORDS, "Q2_K": {"d": "d", "sc": "sc"}}   # Q2_K: (d, dmin), 4 scale bytes


class Weights:
    """A weight arena as kernel arguments, for `slots` x [n, k] matrices of format `fmt`: v1 kernels
    get 5 planes (q, d, dmin, sc, mn; unused ones repeat q) and their (slot, row) strides; v2
    kernels get 6 planes (+ h) with q and h (Q4_K / Q5_K: d, dmin, sc, mn too) as int32 word views,
    a lookup table, 12 strides."""

    def __init__(self, weight, fmt: str):
        self.fmt, self.code = fmt, FMT_CODES[fmt]
        if fmt in RAW_FORMATS:
            self._init_raw(weight)
            return
        planes = {"w": weight} if fmt == "dense" else dict(weight)
        if fmt == "dense" and not weight.dtype.is_floating_point:
            raise ValueError(f"float weights expected for fmt 'dense'; got {weight.dtype} (pass the GGML format name)")
        if set(PLANE_DIV[fmt]) - set(planes):
            raise ValueError(f"{fmt} weights need the planes {sorted(PLANE_DIV[fmt])} of quant.repack; "
                             f"got {sorted(planes)}")
        by_slot = {SLOT_OF.get(name, name): planes[name] for name in PLANE_DIV[fmt]}
        main_name = next(iter(n for n in PLANE_DIV[fmt] if SLOT_OF.get(n) == "q"))
        main = by_slot["q"]
        if main.dim() != 3:
            raise ValueError(f"{fmt} weights must be [slots, N, K'] tensors; got shape {tuple(main.shape)}")
        self.slots, self.n = main.shape[0], main.shape[1]
        self.k = main.shape[2] * PLANE_DIV[fmt][main_name]
        if self.k % BLOCK[fmt]:
            raise ValueError(f"{fmt} rows hold blocks of {BLOCK[fmt]}; K={self.k} is not a multiple")
        for name, div in PLANE_DIV[fmt].items():
            t = planes[name]
            if tuple(t.shape) != (self.slots, self.n, self.k // div) or t.stride(-1) != 1:
                raise ValueError(f"plane {name} of {fmt} weights must be [{self.slots}, {self.n}, "
                                 f"{self.k // div}] with unit stride on the last dim; got "
                                 f"{tuple(t.shape)} with strides {t.stride()}")
        word_planes = {slot: by_slot[slot] for slot in WORD_SLOTS if slot in by_slot and fmt != "dense"}
        if fmt in ("Q4_K", "Q5_K"):
            by_slot.update({slot: planes[name][..., first:] for slot, (name, first) in K_PAIRS.items()})
        word_planes.update({slot: planes[name] for slot, name in V2_WORDS.get(fmt, {}).items()})
        words = {}
        for slot, t in word_planes.items():
            if t.element_size() * t.stride(0) % 4 or t.element_size() * t.stride(1) % 4 or t.data_ptr() % 4:
                raise ValueError(f"{fmt} planes are read as int32 words: slot and row strides and the start "
                                 f"must be multiples of 4 bytes; got strides {t.stride()} of {t.dtype}")
            words[slot] = t if t.dtype == torch.int32 else t.view(torch.int32)
        self.planes = [by_slot.get(slot, main) for slot in SLOTS[:5]]
        self.strides = [st for slot, t in zip(SLOTS, self.planes)
                        for st in ((t.stride(0), t.stride(1)) if slot in by_slot else (0, 0))]
        v2 = [words.get(slot, by_slot.get(slot, main)) for slot in SLOTS] if fmt != "dense" else []
        self.v2_planes = [t if slot in by_slot else v2[0] for slot, t in zip(SLOTS, v2)]
        self.v2_strides = [st for slot, t in zip(SLOTS, self.v2_planes)
                           for st in ((t.stride(0), t.stride(1)) if slot in by_slot else (0, 0))]
        self.h_plane = by_slot.get("h", main)
        self.h_strides = (self.h_plane.stride(0), self.h_plane.stride(1)) if "h" in by_slot else (0, 0)
        self.lut = value_table(fmt, main.device) if fmt in VALUE_TABLES else (self.v2_planes or [main])[0]

    def _init_raw(self, weight) -> None:
        """A format read as stored: one plane of GGML rows [slots, N, row_bytes] in every slot (triton_rawq)."""
        _, block, size = RAW_FORMATS[self.fmt]
        raw = weight.get("raw") if isinstance(weight, dict) else None
        if raw is None or raw.dtype != torch.uint8 or raw.dim() != 3 or raw.shape[2] % size or raw.stride(-1) != 1:
            got = sorted(weight) if isinstance(weight, dict) else type(weight).__name__
            raise ValueError(f"{self.fmt} weights are read as stored: {{'raw': uint8 [slots, N, row_bytes]}} with "
                             f"row_bytes a multiple of {size} and unit last stride (quant.repack); got {got}")
        self.slots, self.n, self.k = raw.shape[0], raw.shape[1], raw.shape[2] // size * block
        self.planes = [raw] * 5
        self.strides = [raw.stride(0), raw.stride(1)] * 5
        self.v2_planes = [raw] * 6
        self.v2_strides = [raw.stride(0), raw.stride(1)] * 6
        self.h_plane, self.h_strides = raw, (raw.stride(0), raw.stride(1))
        self.lut = value_table(self.fmt, raw.device)

    def args(self) -> list:
        """v1 kernel arguments: 5 planes, 10 strides."""
        return [*self.planes, *self.strides]

    def extra_args(self) -> list:
        """Grouped kernels' arguments after args(): the h plane (bytes / int32), the table, 2 strides."""
        return [self.h_plane, self.lut, *self.h_strides]

    def v2_args(self) -> list:
        """v2 kernel arguments: 6 planes, the lookup table, 12 strides."""
        return [*self.v2_planes, self.lut, *self.v2_strides]


# the value table a format's kernels read (float32, flattened): the grid of gguf-py's class of that name, or IQ4_NL's
# 16 values (IQ4_XS)
VALUE_TABLES = {"IQ3_XXS": "IQ3_XXS", "IQ2_XXS": "IQ2_XXS", "IQ4_XS": "IQ4_NL", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_S",
                "IQ3_S": "IQ3_S", "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_S"}


def value_table(fmt: str, device) -> torch.Tensor:
    """fmt's value table (VALUE_TABLES) as float32 on `device` (cached per device)."""
    from gguf import quants as gq

    from moetier.quant.bits import table
    from moetier.quant.iquants import _grid
    name = VALUE_TABLES[fmt]
    cls = getattr(gq, name)
    build = (lambda: torch.tensor(cls.kvalues, dtype=torch.float32)) if name == "IQ4_NL" else \
        (lambda: _grid(cls).reshape(-1).float().contiguous())
    return table(f"values_{name}", device, build)
