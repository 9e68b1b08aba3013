"""Shared test helpers: tiny random checkpoints built by transformers, and comparisons."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from moetier.weights.loader import load_model


def tiny_checkpoint(path: Path, hf_cls, config, seed: int = 0, fused: bool = False, scale: float = 1.0,
                    init=None):
    """Build a random `hf_cls(config)` (fp32), save it to `path` and return the reference model.
    fused=True writes the in-memory (transformers 5 fused-expert) state dict instead of the
    per-expert names that save_pretrained converts back to. `scale` multiplies every weight's
    init std so tiny models produce non-trivial logits. `init(model)`, if given, runs after the
    random init and before saving (e.g. to randomise buffers such as a router's correction bias)."""
    torch.manual_seed(seed)
    model = hf_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or "bias" in name or "sinks" in name:
                p.normal_(0, 0.02 * scale if p.dim() >= 2 else 0.1)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
        if init is not None:
            init(model)
    model.save_pretrained(path)
    if fused:
        for f in path.glob("*.safetensors"):
            f.unlink()
        (path / "model.safetensors.index.json").unlink(missing_ok=True)
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        save_file(sd, str(path / "model.safetensors"))
    return model


def ours_logits(model, tokens: torch.Tensor, split: int, ctx: int | None = None) -> torch.Tensor:
    """Prefill tokens[:split] in one call, then decode the rest one by one with the KV cache (of ctx
    positions; default: just enough)."""
    cache = model.make_cache(ctx or len(tokens) + 4, torch.float32, tokens.device)
    with torch.inference_mode():
        out = [model(tokens[:split], cache)]
        for i in range(split, len(tokens)):
            out.append(model(tokens[i:i + 1], cache))
    return torch.cat(out)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check_against_reference(path: Path, ref, vocab: int, seed: int = 1, n_greedy: int = 32):
    """Prefill + cached decode logits within 1e-4 relative, and 32 greedy tokens identical."""
    model, _, _ = load_model(path)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (13,), generator=g)
    with torch.no_grad():
        want = ref(tokens[None]).logits[0]
    got = ours_logits(model, tokens, 7)
    err = max_rel_err(got, want)
    assert err <= 1e-4, f"logits differ: max rel err {err:.2e}"
    prompt = tokens[:5]
    with torch.no_grad():
        ref_out = ref.generate(prompt[None], max_new_tokens=n_greedy, min_new_tokens=n_greedy, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    from moetier.runtime.generate import greedy_tokens
    ours = greedy_tokens(model, prompt.tolist(), n_greedy)
    assert ours == ref_out, f"greedy tokens differ:\n ours {ours}\n ref  {ref_out}"
    return model


def bandwidths_home(monkeypatch, tmp_path, bw: dict) -> None:
    """A fresh HOME whose moetier bandwidth cache holds `bw` (plan then measures nothing)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".cache" / "moetier").mkdir(parents=True)
    from moetier.memory.bandwidth import RAM_METHOD
    (tmp_path / ".cache" / "moetier" / "bandwidth.json").write_text(json.dumps({"ram_method": RAM_METHOD, **bw}))
