"""Train moetier's embedded default model: a tiny Qwen3-MoE (transformers' Qwen3MoeForCausalLM).

    python tools/build_corpus.py                                  # .data/default_{train,val}.npy + tokenizer
    python tools/train_default_model.py train --out /tmp/d        # GPU: bf16 autocast, AdamW, cosine
    python tools/train_default_model.py train --out /tmp/c --epochs 4          # another variant
    python tools/train_default_model.py pick /tmp/c /tmp/d --out OUT   # keep the best val loss
    python tools/train_default_model.py eval moetier/assets/default  # CPU: val loss + expert histogram

The schedule runs to `--epochs` passes over the training tokens or `--minutes` of wall time,
whichever comes first (cosine over that progress); the checkpoint with the lowest held-out
loss is kept. The corpus is small (a few million tokens), so more epochs overfit; `pick`
chooses among variants trained with different epoch counts.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / ".data"
ASSETS = ROOT / "moetier" / "assets" / "default"
GENERATION = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1}


def model_config(vocab_size: int, eot: int, im_end: int, **kw):
    from transformers import Qwen3MoeConfig
    cfg = dict(vocab_size=vocab_size, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
               num_attention_heads=6, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=256, norm_topk_prob=True, max_position_embeddings=2048,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
               rms_norm_eps=1e-6, output_router_logits=True, router_aux_loss_coef=0.01, use_cache=False,
               bos_token_id=eot, eos_token_id=[eot, im_end], pad_token_id=eot)
    cfg.update(kw)
    return Qwen3MoeConfig(**cfg)


# ---------------------------------------------------------------- experts: one grouped matmul per projection
def grouped_experts_forward(self, x, top_k_index, top_k_weights):
    """Qwen3MoeExperts.forward as two grouped matmuls in bf16 (sort token-expert pairs by expert).
    x [T, D], top_k_index/weights [T, k] -> [T, D]. Same math as the eager loop."""
    T, k = top_k_index.shape
    flat = top_k_index.reshape(-1)                                        # [S = T*k]
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)                     # [E] group ends
    dt = torch.bfloat16
    xs = x[order // k].to(dt)                                             # [S, D] grouped by expert
    gate_up = F.grouped_mm(xs, self.gate_up_proj.to(dt).transpose(1, 2), offs=offs)   # [S, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    h = F.silu(gate) * up                                                 # [S, I]
    y = F.grouped_mm(h, self.down_proj.to(dt).transpose(1, 2), offs=offs)  # [S, D]
    y = y.float() * top_k_weights.reshape(-1)[order, None].float()
    out = torch.zeros(T * k, y.shape[-1], dtype=torch.float32, device=x.device)
    out[order] = y                                                        # back to [T*k] token order
    return out.view(T, k, -1).sum(1).to(x.dtype)


def use_grouped_experts(model) -> int:
    n = 0
    for m in model.modules():
        if type(m).__name__ == "Qwen3MoeExperts":
            m.forward = types.MethodType(grouped_experts_forward, m)
            n += 1
    return n


def check_grouped(model, device) -> float:
    """Relative error of the grouped forward against transformers' eager loop on random inputs."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as mq
    experts = next(m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts")
    x = torch.randn(300, model.config.hidden_size, device=device)
    idx = torch.stack([torch.randperm(model.config.num_experts, device=device)[:2] for _ in range(300)])
    w = torch.rand(300, 2, device=device)
    eager = getattr(mq.Qwen3MoeExperts.forward, "__wrapped__", None)   # the class's own loop
    with torch.no_grad():
        want = eager(experts, x, idx, w) if eager is not None else None
    got = grouped_experts_forward(experts, x.requires_grad_(), idx, w)
    got.square().sum().backward()                                          # the backward must run too
    experts.zero_grad(set_to_none=True)
    return float("nan") if want is None else ((got.detach() - want).norm() / want.norm()).item()


# ---------------------------------------------------------------- data
def load_split(name: str, device) -> torch.Tensor:
    arr = np.load(DATA / f"default_{name}.npy")
    return torch.from_numpy(arr.astype(np.int32)).to(device)


def batch(tokens: torch.Tensor, bsz: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - seq, (bsz,), generator=gen, device="cpu").to(tokens.device)
    return tokens[starts[:, None] + torch.arange(seq, device=tokens.device)].long()   # [B, seq]


def val_windows(tokens: torch.Tensor, seq: int, max_windows: int) -> torch.Tensor:
    n = min(max_windows, tokens.numel() // seq)
    return tokens[: n * seq].view(n, seq).long()


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, bsz: int, amp: bool) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), bsz):
        x = windows[i:i + bsz]
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x, output_router_logits=False).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                               reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


@torch.no_grad()
def expert_histogram(model, windows: torch.Tensor, bsz: int, amp: bool) -> list[list[float]]:
    """Fraction of top-k slots each expert takes, per layer, over `windows`."""
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    counts = torch.zeros(model.config.num_hidden_layers, E)
    model.eval()
    for i in range(0, len(windows), bsz):
        x = windows[i:i + bsz]
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
            out = model(input_ids=x, output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            top = logits.float().topk(k, dim=-1).indices.reshape(-1).cpu()
            counts[layer] += torch.bincount(top, minlength=E).float()
    model.train()
    return (counts / counts.sum(1, keepdim=True)).tolist()


def format_histogram(hist) -> str:
    lines = []
    for layer, row in enumerate(hist):
        p = torch.tensor(row)
        ent = -(p * p.clamp_min(1e-12).log()).sum().item() / math.log(len(row))
        lines.append(f"layer {layer}: " + " ".join(f"{v * 100:5.1f}" for v in row)
                     + f"   (% of top-k slots; max/min {p.max().item() / max(p.min().item(), 1e-9):.1f}x,"
                       f" normalised entropy {ent:.3f})")
    return "\n".join(lines)


# ---------------------------------------------------------------- training
def lr_at(progress: float, step: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train(a) -> None:
    from tokenizers import Tokenizer
    from transformers import Qwen3MoeForCausalLM
    device = "cuda" if torch.cuda.is_available() else "cpu"
    amp = device == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(a.seed)
    tk = Tokenizer.from_file(str(Path(a.assets) / "tokenizer.json"))
    eot, im_end = tk.token_to_id("<|endoftext|>"), tk.token_to_id("<|im_end|>")
    vocab = (tk.get_vocab_size() + 63) // 64 * 64
    cfg = model_config(vocab, eot, im_end, **json.loads(a.config_overrides))
    model = Qwen3MoeForCausalLM(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    n_experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = n_params - n_experts * (1 - cfg.num_experts_per_tok / cfg.num_experts)
    print(f"device {device} ({torch.cuda.get_device_name() if amp else 'cpu'}), torch {torch.__version__}, "
          f"params {n_params / 1e6:.2f} M ({n_params * 2 / 2**20:.1f} MiB bf16), active/token {active / 1e6:.2f} M",
          flush=True)
    if a.experts == "grouped":
        try:
            err = check_grouped(model, device)
        except Exception as e:  # no grouped_mm kernel for this device/dtype: keep transformers' loop
            err = f"{type(e).__name__}: {e}"
        print(f"grouped experts vs transformers' eager loop: rel err {err}", flush=True)
        if isinstance(err, float) and err < 2e-2:
            use_grouped_experts(model)
        else:
            print("falling back to the eager experts loop", flush=True)

    train_tokens, val_tokens = load_split("train", device), load_split("val", device)
    windows = val_windows(val_tokens, a.seq, a.val_windows)
    print(f"train tokens {train_tokens.numel():,}, val tokens {windows.numel():,} in {len(windows)} windows",
          flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95),
                            eps=1e-8, fused=amp)
    gen = torch.Generator().manual_seed(a.seed)
    target = a.epochs * train_tokens.numel()
    step_tokens = a.batch * a.seq
    budget_s = a.minutes * 60
    best = (float("inf"), None, 0)
    t0 = time.time()
    last_eval, seen, step, measured = t0, 0, 0, False
    log = []
    model.train()
    while True:
        elapsed = time.time() - t0
        progress = max(seen / target, elapsed / budget_s)
        if progress >= 1.0:
            break
        lr = lr_at(progress, step, a.lr, a.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch(train_tokens, a.batch, a.seq, gen)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen += step_tokens
        step += 1
        if step % a.log_every == 0 or step == 20:
            loss, aux = out.loss.item(), out.aux_loss.item()  # syncs
            el = time.time() - t0
            if step == 20:
                t20, s20 = el, seen
            if not measured and el > 45 and step > 20:
                measured = True
                print(f"throughput after {el:.0f} s: {(seen - s20) / (el - t20):,.0f} tok/s "
                      f"({(el - t20) / (step - 20) * 1000:.1f} ms/step of {step_tokens} tokens)", flush=True)
            print(f"step {step} tokens {seen / 1e6:.1f} M ({seen / train_tokens.numel():.1f} ep) loss "
                  f"{loss - cfg.router_aux_loss_coef * aux:.3f} aux {aux:.3f} lr {lr:.2e} t {el:.0f} s", flush=True)
        if time.time() - last_eval > a.eval_every_s:
            last_eval = time.time()
            v = evaluate(model, windows, a.batch, amp)
            log.append({"step": step, "tokens": seen, "val_loss": v, "t": time.time() - t0})
            print(f"  val loss {v:.4f} at {seen / 1e6:.1f} M tokens", flush=True)
            if v < best[0]:
                best = (v, {k: t.detach().to("cpu", copy=True) for k, t in model.state_dict().items()}, seen)
    el = time.time() - t0
    v = evaluate(model, windows, a.batch, amp)
    log.append({"step": step, "tokens": seen, "val_loss": v, "t": el})
    print(f"done: {step} steps, {seen / 1e6:.1f} M tokens ({seen / train_tokens.numel():.1f} epochs) in {el:.0f} s "
          f"= {seen / el:,.0f} tok/s; final val loss {v:.4f}", flush=True)
    if best[1] is not None and best[0] < v:
        print(f"keeping the best checkpoint: val loss {best[0]:.4f} at {best[2] / 1e6:.1f} M tokens", flush=True)
        model.load_state_dict(best[1])
        v, seen_best = best[0], best[2]
    else:
        seen_best = seen
    hist = expert_histogram(model, windows, a.batch, amp)
    print(format_histogram(hist), flush=True)
    sample = greedy_sample(model, tk, "The Python programming language", 40, amp)
    print(f"greedy sample: {sample!r}", flush=True)
    result = {"val_loss": v, "tokens_trained": seen_best, "tokens_run": seen, "steps": step, "seconds": el,
              "tok_per_s": seen / el, "train_tokens": int(train_tokens.numel()), "epochs": seen_best /
              train_tokens.numel(), "params": n_params, "active_params": active, "expert_histogram": hist,
              "sample": sample, "args": {k: v for k, v in vars(a).items() if k != "func"}, "val_log": log}
    save(model, cfg, Path(a.out), a.shard_size)
    (Path(a.out) / "train_result.json").write_text(json.dumps(result, indent=1) + "\n")


@torch.no_grad()
def greedy_sample(model, tk, prompt: str, n: int, amp: bool) -> str:
    ids = [tk.token_to_id("<|endoftext|>")] + tk.encode(prompt).ids
    x = torch.tensor([ids], device=next(model.parameters()).device)
    model.eval()
    for _ in range(n):  # no cache: short and version-proof
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
            nxt = model(input_ids=x, output_router_logits=False).logits[0, -1].argmax()
        x = torch.cat([x, nxt.view(1, 1)], 1)
    model.train()
    return prompt + tk.decode(x[0, len(ids):].tolist())


def save(model, cfg, out: Path, shard_size: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = model.to("cpu", torch.bfloat16)
    model.config.output_router_logits = False
    model.config.use_cache = True
    model.save_pretrained(out, max_shard_size=shard_size)
    fix_config(out / "config.json")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
           **GENERATION}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    sizes = {f.name: f.stat().st_size for f in sorted(out.iterdir())}
    print("saved:", ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sizes.items()), flush=True)


def fix_config(path: Path) -> None:
    """transformers writes the alias `num_local_experts`; Qwen3-MoE checkpoints spell it `num_experts`."""
    cfg = json.loads(path.read_text())
    if "num_local_experts" in cfg:
        cfg = {("num_experts" if k == "num_local_experts" else k): v for k, v in cfg.items()}
    path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")


def pick(a) -> None:
    runs = [Path(d) for d in a.runs if (Path(d) / "train_result.json").exists()]
    if not runs:
        raise SystemExit("no finished runs (train_result.json) among " + ", ".join(a.runs))
    scores = {d: json.loads((d / "train_result.json").read_text())["val_loss"] for d in runs}
    for d, v in scores.items():
        print(f"{d}: val loss {v:.4f}")
    best = min(scores, key=scores.get)
    print(f"best: {best}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in best.iterdir():
        shutil.copy(f, out / f.name)


def eval_dir(a) -> None:
    from transformers import Qwen3MoeForCausalLM
    torch.set_num_threads(a.threads or torch.get_num_threads())
    model = Qwen3MoeForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    windows = val_windows(load_split("val", "cpu"), a.seq, a.val_windows)
    print(f"val loss {evaluate(model, windows, 8, False):.4f} on {windows.numel():,} held-out tokens")
    print(format_histogram(expert_histogram(model, windows, 8, False)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train one variant and save it (sharded, bf16) to --out")
    t.add_argument("--out", required=True)
    t.add_argument("--assets", default=str(ASSETS), help="where build_corpus.py wrote tokenizer.json")
    t.add_argument("--epochs", type=float, default=6.0, help="6 gave the best held-out loss (docs/models.md)")
    t.add_argument("--minutes", type=float, default=3.0, help="wall-clock cap on the schedule")
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--experts", choices=["grouped", "eager"], default="grouped")
    t.add_argument("--eval-every-s", type=float, default=10.0)
    t.add_argument("--val-windows", type=int, default=256)
    t.add_argument("--log-every", type=int, default=100)
    t.add_argument("--shard-size", default="14MB", help="max shard size (14MB = 13.4 MiB)")
    t.add_argument("--config-overrides", default="{}", help='JSON, e.g. {"num_hidden_layers": 2}')
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=train)
    p = sub.add_parser("pick", help="copy the run with the lowest val loss to --out")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", required=True)
    p.set_defaults(func=pick)
    e = sub.add_parser("eval", help="val loss and per-layer expert histogram of a saved model (CPU)")
    e.add_argument("model", nargs="?", default=str(ASSETS))
    e.add_argument("--seq", type=int, default=512)
    e.add_argument("--val-windows", type=int, default=64)
    e.add_argument("--threads", type=int, default=None)
    e.set_defaults(func=eval_dir)
    a = ap.parse_args(argv)
    a.func(a)


if __name__ == "__main__":
    main(sys.argv[1:])
