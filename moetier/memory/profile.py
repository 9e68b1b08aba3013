"""Expert activation profiles: per (MoE layer, expert) route counts and routing weight.

A profile file (JSON) is written by `moetier profile MODEL --prompts FILE --out profile.json` or
by `--save-profile FILE` (counts learned while running, written at exit). `--expert-profile FILE`
ranks all (layer, expert) pairs globally by score; the ranking picks which experts the fast tier
pins or preloads and so sets each layer's slot count (LESSONS.md section 2), and orders the RAM
bank's preload. The score is the routing weight of decode tokens when the profile has any
(answers use other experts than prompts), else of all tokens.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError

FORMAT = "moetier-expert-profile"
KINDS = ("tokens", "weight", "decode_tokens", "decode_weight")


class ExpertProfile:
    """Counts [L, E] (float64 torch tensors on `device`, so recording never syncs with the host)."""

    def __init__(self, layers: list[int], num_experts: int, model_type: str = "", device="cpu"):
        self.layers, self.num_experts, self.model_type = list(layers), num_experts, model_type
        self.counts = {k: torch.zeros(len(layers), num_experts, dtype=torch.float64, device=device) for k in KINDS}
        self.meta = {"prompts": 0, "generated_tokens": 0}
        self._pending: dict[str, np.ndarray] | None = None     # add_host's sums not yet in counts

    def add(self, li: int, ids: torch.Tensor, w: torch.Tensor, decode: bool) -> None:
        """Record one call of MoE layer li: ids, w [T, k]."""
        flat = ids.reshape(-1)
        ones = torch.ones(flat.shape[0], dtype=torch.float64, device=flat.device)
        wf = w.reshape(-1).to(torch.float64)
        self.counts["tokens"][li].index_add_(0, flat, ones)
        self.counts["weight"][li].index_add_(0, flat, wf)
        if decode:
            self.counts["decode_tokens"][li].index_add_(0, flat, ones)
            self.counts["decode_weight"][li].index_add_(0, flat, wf)

    def add_host(self, ids: np.ndarray, w: np.ndarray, decode: bool) -> None:
        """Record one token of every MoE layer from host arrays ids, w [L, k] (the graphed decode
        step): summed on the host, added to `counts` when they are next read."""
        if self._pending is None:
            self._pending = {k: np.zeros(tuple(self.counts[k].shape)) for k in KINDS}
        rows = np.broadcast_to(np.arange(ids.shape[0])[:, None], ids.shape)
        for k in (("tokens", "decode_tokens") if decode else ("tokens",)):
            np.add.at(self._pending[k], (rows, ids), 1.0)
        for k in (("weight", "decode_weight") if decode else ("weight",)):
            np.add.at(self._pending[k], (rows, ids), w)

    def flush(self) -> None:
        if self._pending is not None:
            for k, v in self._pending.items():
                self.counts[k] += torch.from_numpy(v).to(self.counts[k].device)
            self._pending = None

    def score(self) -> np.ndarray:
        self.flush()
        dw = self.counts["decode_weight"].cpu().numpy()
        return dw if dw.sum() > 0 else self.counts["weight"].cpu().numpy()

    def share(self) -> np.ndarray:
        """Each expert's share of its layer's routes [L, E] (uniform where nothing was recorded)."""
        s = self.score()
        tot = s.sum(axis=1, keepdims=True)
        uniform = np.full_like(s, 1.0 / self.num_experts)
        return np.where(tot > 0, s / np.where(tot > 0, tot, 1), uniform)

    def ranking(self, layers: list[int] | None = None) -> list[tuple[int, int]]:
        """(li, e) pairs hottest first over all layers (or the given MoE layer indices); ties by
        (li, e). Shares are compared, so a layer seen more often does not crowd out the others."""
        share = self.share()
        keep = range(len(self.layers)) if layers is None else layers
        pairs = [(li, e) for li in keep for e in range(self.num_experts)]
        return sorted(pairs, key=lambda p: (-share[p], p))

    # ------------------------------------------------------------------ files
    def to_json(self) -> dict:
        self.flush()
        return {"format": FORMAT, "version": 1, "model_type": self.model_type, "num_experts": self.num_experts,
                "layers": self.layers, **self.meta,
                **{k: [[round(float(v), 6) for v in row] for row in t.cpu().tolist()]
                   for k, t in self.counts.items()}}

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json()))
        tmp.replace(path)

    def merge(self, other: "ExpertProfile") -> None:
        self.flush()
        other.flush()
        for k in KINDS:
            self.counts[k] += other.counts[k].to(self.counts[k].device)
        for k, v in other.meta.items():
            self.meta[k] = self.meta.get(k, 0) + v

    @classmethod
    def load(cls, path: str | Path, layers: list[int] | None = None, num_experts: int | None = None,
             device="cpu") -> "ExpertProfile":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except OSError as e:
            raise UserError(f"cannot read the expert profile {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not a valid expert profile (bad JSON: {e.msg} at line {e.lineno})") from None
        if d.get("format") != FORMAT:
            raise UserError(f"{path}: not a moetier expert profile (write one with `moetier profile`)")
        if layers is not None and list(d["layers"]) != list(layers):
            raise UserError(f"{path}: the profile is for MoE layers {d['layers'][:6]}..., but this model has "
                            f"{list(layers)[:6]}...: it was made for another model")
        if num_experts is not None and d["num_experts"] != num_experts:
            raise UserError(f"{path}: the profile has {d['num_experts']} experts per layer, this model "
                            f"{num_experts}: it was made for another model")
        p = cls(d["layers"], d["num_experts"], d.get("model_type", ""), device)
        for k in KINDS:
            if k in d:
                p.counts[k] = torch.tensor(d[k], dtype=torch.float64, device=device)
        p.meta = {k: d.get(k, 0) for k in ("prompts", "generated_tokens")}
        return p


class Recorder:
    """Counts routes of any model by hooking every experts module (DenseExperts or TieredExperts)."""

    def __init__(self, model, model_type: str = "", decode_max: int = 8):
        from .layout import expert_modules, layer_index
        mods = expert_modules(model)
        if not mods:
            raise UserError("this model has no MoE layers to profile")
        self.profile = ExpertProfile([layer_index(p) for p, _ in mods], mods[0][1].num_experts, model_type)
        self.decode_max = decode_max
        self.handles = [m.register_forward_pre_hook(self._hook(li)) for li, (_, m) in enumerate(mods)]

    def _hook(self, li: int):
        def hook(_mod, inputs):
            x, ids, w = inputs[:3]
            self.profile.add(li, ids.cpu(), w.cpu(), ids.shape[0] <= self.decode_max)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
