"""llama.cpp's GGUF architectures seen as moetier's: tensor-name tables and metadata keys.

One `Arch` per GGUF `general.architecture`: which model_type it loads as, how each of our
parameter names is stored (`blk.N.attn_q.weight` <-> `model.layers.N.self_attn.q_proj.weight`),
the transforms llama.cpp's converter applied (Q/K RoPE permutation, DeepSeek's split kv_b), and
the metadata <-> config.json keys. GGUF lists dims fastest-first; gguf.py reverses them, so every
shape here is torch's: ffn_gate_exps [E, I, D], ffn_down_exps [E, D, I].
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import CheckpointError

# ---------------------------------------------------------------- transforms


def _unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's LlamaModel.permute (rows of each head: halves -> pairs)."""
    return t.reshape(heads, t.shape[0] // heads // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def _permute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute: HF's rotate-half rows -> llama.cpp's pairs."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


@dataclass
class Tensor:
    """One of our tensors made from GGUF tensors `names` (layer-relative for blk.N.*):
    ours = to_ours(*gguf_tensors, args); [gguf tensors] = to_gguf(ours, args)."""
    names: tuple[str, ...]
    to_ours: Callable | None = None
    to_gguf: Callable | None = None

    def read(self, ts: list[torch.Tensor], args) -> torch.Tensor:
        return ts[0] if self.to_ours is None else self.to_ours(*ts, args)

    def write(self, t: torch.Tensor, args) -> list[torch.Tensor]:
        return [t] if self.to_gguf is None else list(self.to_gguf(t, args))


def T(name: str) -> Tensor:
    return Tensor((name,))


def _q_perm(name: str) -> Tensor:
    return Tensor((name,), lambda t, a: _unpermute(t, a.num_attention_heads),
                  lambda t, a: [_permute(t, a.num_attention_heads)])


def _k_perm(name: str) -> Tensor:
    return Tensor((name,), lambda t, a: _unpermute(t, a.num_key_value_heads),
                  lambda t, a: [_permute(t, a.num_key_value_heads)])


def _kv_b_join(k_b: torch.Tensor, v_b: torch.Tensor, a) -> torch.Tensor:
    # attn_k_b [H, R, Dn] (transposed for the absorbed MLA), attn_v_b [H, Dv, R] -> kv_b_proj [H*(Dn+Dv), R]
    kv = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
    return kv.reshape(-1, kv.shape[-1])


def _kv_b_split(kv: torch.Tensor, a) -> list[torch.Tensor]:
    h, dn, dv = a.num_attention_heads, a.get("qk_nope_head_dim"), a.get("v_head_dim")
    k_b, v_b = kv.view(h, dn + dv, kv.shape[-1]).split([dn, dv], dim=1)
    return [k_b.transpose(1, 2).contiguous(), v_b.contiguous()]


def _plus_one(name: str) -> Tensor:
    """Zero-centred RMSNorm weights: the converter stores 1 + w, as llama.cpp's plain RMSNorm wants."""
    return Tensor((name,), lambda t, a: t - 1, lambda t, a: [t + 1])


def _zero_centred(a) -> bool:
    return a.model_type == "qwen3_next"


def _qkvz_join(qkv: torch.Tensor, z: torch.Tensor, a) -> torch.Tensor:
    # attn_qkv [q all heads | k all heads | v all heads] and attn_gate [z] -> in_proj_qkvz, grouped per
    # key head: [q_h | k_h | v_h | z_h] for h in Hk (v_h, z_h hold the Hv/Hk value heads of key head h)
    hk, dk, d = a.get("linear_num_key_heads"), a.get("linear_key_head_dim"), qkv.shape[-1]
    q, k, v = qkv.split([hk * dk, hk * dk, qkv.shape[0] - 2 * hk * dk])
    return torch.cat([q.view(hk, -1, d), k.view(hk, -1, d), v.view(hk, -1, d), z.view(hk, -1, d)], 1).view(-1, d)


def _qkvz_split(w: torch.Tensor, a) -> list[torch.Tensor]:
    hk, dk, d = a.get("linear_num_key_heads"), a.get("linear_key_head_dim"), w.shape[-1]
    dvr = (w.shape[0] // hk - 2 * dk) // 2                      # value rows per key head
    q, k, v, z = w.view(hk, -1, d).split([dk, dk, dvr, dvr], 1)
    return [torch.cat([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)]), z.reshape(-1, d)]


# ---------------------------------------------------------------- name tables

GLOBAL = {
    "model.embed_tokens.weight": T("token_embd.weight"),
    # stored as 1 + w for zero-centred architectures (see _plus_one)
    "model.norm.weight": Tensor(("output_norm.weight",), lambda t, a: t - 1 if _zero_centred(a) else t,
                                lambda t, a: [t + 1 if _zero_centred(a) else t]),
    "lm_head.weight": T("output.weight"),
}

ATTN = {  # plain GQA, our names under model.layers.N.
    "input_layernorm.weight": T("attn_norm.weight"),
    "self_attn.q_proj.weight": T("attn_q.weight"),
    "self_attn.k_proj.weight": T("attn_k.weight"),
    "self_attn.v_proj.weight": T("attn_v.weight"),
    "self_attn.o_proj.weight": T("attn_output.weight"),
    "self_attn.q_proj.bias": T("attn_q.bias"),
    "self_attn.k_proj.bias": T("attn_k.bias"),
    "self_attn.v_proj.bias": T("attn_v.bias"),
    "self_attn.o_proj.bias": T("attn_output.bias"),
    "self_attn.q_norm.weight": T("attn_q_norm.weight"),
    "self_attn.k_norm.weight": T("attn_k_norm.weight"),
    "post_attention_layernorm.weight": T("ffn_norm.weight"),
}

DENSE_MLP = {
    "mlp.gate_proj.weight": T("ffn_gate.weight"),
    "mlp.up_proj.weight": T("ffn_up.weight"),
    "mlp.down_proj.weight": T("ffn_down.weight"),
}

ROUTER = {"mlp.gate.weight": T("ffn_gate_inp.weight")}

SHARED = {
    "mlp.shared_experts.gate_proj.weight": T("ffn_gate_shexp.weight"),
    "mlp.shared_experts.up_proj.weight": T("ffn_up_shexp.weight"),
    "mlp.shared_experts.down_proj.weight": T("ffn_down_shexp.weight"),
    "mlp.gate.e_score_correction_bias": T("exp_probs_b.bias"),
}

MLA = {
    "input_layernorm.weight": T("attn_norm.weight"),
    "self_attn.q_proj.weight": T("attn_q.weight"),
    "self_attn.q_a_proj.weight": T("attn_q_a.weight"),
    "self_attn.q_a_layernorm.weight": T("attn_q_a_norm.weight"),
    "self_attn.q_b_proj.weight": T("attn_q_b.weight"),
    "self_attn.kv_a_proj_with_mqa.weight": T("attn_kv_a_mqa.weight"),
    "self_attn.kv_a_layernorm.weight": T("attn_kv_a_norm.weight"),
    # current converters split kv_b into k_b / v_b; older files keep attn_kv_b
    "self_attn.kv_b_proj.weight": [Tensor(("attn_k_b.weight", "attn_v_b.weight"), _kv_b_join, _kv_b_split),
                                   T("attn_kv_b.weight")],
    "self_attn.o_proj.weight": T("attn_output.weight"),
    "post_attention_layernorm.weight": T("ffn_norm.weight"),
}

QWEN3_NEXT = {  # convert_hf_to_gguf's Qwen3NextModel: norms + 1, A as -exp(A_log), conv1d squeezed,
    # in_proj_qkvz regrouped into attn_qkv + attn_gate (see _qkvz_join); in_proj_ba as is
    "input_layernorm.weight": _plus_one("attn_norm.weight"),
    "post_attention_layernorm.weight": _plus_one("post_attention_norm.weight"),
    "self_attn.q_proj.weight": T("attn_q.weight"),           # [query | gate] per head, as ours
    "self_attn.k_proj.weight": T("attn_k.weight"),
    "self_attn.v_proj.weight": T("attn_v.weight"),
    "self_attn.o_proj.weight": T("attn_output.weight"),
    "self_attn.q_norm.weight": _plus_one("attn_q_norm.weight"),
    "self_attn.k_norm.weight": _plus_one("attn_k_norm.weight"),
    "linear_attn.in_proj_qkvz.weight": Tensor(("attn_qkv.weight", "attn_gate.weight"), _qkvz_join, _qkvz_split),
    "linear_attn.in_proj_ba.weight": T("ssm_ba.weight"),
    "linear_attn.conv1d.weight": Tensor(("ssm_conv1d.weight",), lambda t, a: t.unsqueeze(1),
                                        lambda t, a: [t.squeeze(1)]),            # [C, K] <-> [C, 1, K]
    "linear_attn.A_log": Tensor(("ssm_a",), lambda t, a: torch.log(-t), lambda t, a: [-torch.exp(t)]),
    "linear_attn.dt_bias": T("ssm_dt.bias"),
    "linear_attn.norm.weight": T("ssm_norm.weight"),          # a plain RMSNorm weight: not shifted
    "linear_attn.out_proj.weight": T("ssm_out.weight"),
    "mlp.shared_expert.gate_proj.weight": T("ffn_gate_shexp.weight"),
    "mlp.shared_expert.up_proj.weight": T("ffn_up_shexp.weight"),
    "mlp.shared_expert.down_proj.weight": T("ffn_down_shexp.weight"),
    "mlp.shared_expert_gate.weight": T("ffn_gate_inp_shexp.weight"),
    **DENSE_MLP, **ROUTER,
}

# our stacked expert params (under model.layers.N.mlp.experts.) -> fused GGUF tensors, concatenated on
# the per-expert row dim: gate_up_proj [E, 2I, D] = gate rows then up rows, as DenseExperts keeps them
EXPERTS = {
    "gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
    "down_proj": ("ffn_down_exps.weight",),
}
EXPERT_BIASES = {
    "gate_up_bias": ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
    "down_bias": ("ffn_down_exps.bias",),
}


@dataclass
class Arch:
    gguf: str                  # general.architecture
    model_type: str            # our ARCHS key
    layer: dict                # our name under model.layers.N. -> Tensor | [alternatives]
    experts: dict = field(default_factory=lambda: dict(EXPERTS))
    experts_prefix: str = "mlp"


ARCHS: dict[str, Arch] = {
    "qwen3moe": Arch("qwen3moe", "qwen3_moe", {**ATTN, **DENSE_MLP, **ROUTER}),
    "olmoe": Arch("olmoe", "olmoe", {**ATTN, **ROUTER}),
    "llama": Arch("llama", "mixtral", {**ATTN, "self_attn.q_proj.weight": _q_perm("attn_q.weight"),
                                       "self_attn.k_proj.weight": _k_perm("attn_k.weight"), **ROUTER}),
    "deepseek2": Arch("deepseek2", "deepseek_v3", {**MLA, **DENSE_MLP, **ROUTER, **SHARED}),
    "glm4moe": Arch("glm4moe", "glm4_moe", {**ATTN, "post_attention_layernorm.weight": T("post_attention_norm.weight"),
                                            **DENSE_MLP, **ROUTER, **SHARED}),
    "gpt-oss": Arch("gpt-oss", "gpt_oss", {
        **ATTN, "post_attention_layernorm.weight": T("post_attention_norm.weight"),
        "self_attn.sinks": T("attn_sinks.weight"),
        "mlp.router.weight": T("ffn_gate_inp.weight"), "mlp.router.bias": T("ffn_gate_inp.bias")},
        experts={**EXPERTS, **EXPERT_BIASES}),
    "qwen3next": Arch("qwen3next", "qwen3_next", QWEN3_NEXT),
}
BY_MODEL_TYPE = {a.model_type: a for a in ARCHS.values()}


def arch_of(name: str, where: str) -> Arch:
    if name not in ARCHS:
        raise CheckpointError(f"{where}: GGUF architecture {name!r} is not supported; moetier reads "
                              f"{', '.join(sorted(ARCHS))} (the MoE architectures it implements)")
    return ARCHS[name]


# ---------------------------------------------------------------- metadata -> config.json


def _first(v):
    """Per-layer arrays (head_count_kv, feed_forward_length on some models) -> one value."""
    if isinstance(v, list):
        vals = [x for x in v if x]
        return max(vals) if vals else (v[0] if v else None)
    return v


def hf_config(meta: dict, shapes: dict | None = None) -> dict:
    """GGUF metadata (+ tensor name -> torch shape, for what only the tensors tell: tied output,
    dense layers, biases) -> a config.json-like dict for ModelArgs.from_hf."""
    arch = meta.get("general.architecture")
    a = arch_of(arch, "GGUF metadata")
    shapes = shapes or {}
    names = set(shapes)

    def k(key, default=None):
        v = meta.get(f"{arch}.{key}")
        return default if v is None else _first(v)

    heads = k("attention.head_count")
    hidden = k("embedding_length")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = k("vocab_size") or (len(tokens) if tokens else None)
    if "token_embd.weight" in shapes:
        vocab = shapes["token_embd.weight"][0]
    cfg = {
        "model_type": a.model_type, "vocab_size": vocab, "hidden_size": hidden,
        "num_hidden_layers": k("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": k("attention.head_count_kv", heads),
        "intermediate_size": k("feed_forward_length", 0),
        "max_position_embeddings": k("context_length", 4096),
        "rms_norm_eps": k("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": k("rope.freq_base", 10000.0),
        "head_dim": k("attention.key_length") or (hidden // heads if hidden and heads else None),
        "num_experts": k("expert_count", 0), "num_experts_per_tok": k("expert_used_count", 0),
        "moe_intermediate_size": k("expert_feed_forward_length", 0),
        "tie_word_embeddings": bool(names) and "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": [i for i in (meta.get("tokenizer.ggml.eos_token_id"),
                                     meta.get("tokenizer.ggml.eot_token_id")) if i is not None],
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    scaling = _rope_scaling(k)
    if scaling:
        cfg["rope_scaling"] = scaling
    layers = range(cfg["num_hidden_layers"] or 0)
    if arch == "qwen3moe":
        cfg["norm_topk_prob"] = True   # llama.cpp always renormalises Qwen3-MoE's top-k weights
        if names:
            cfg["mlp_only_layers"] = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in names]
    elif arch == "olmoe":
        cfg["norm_topk_prob"] = False
        cfg["moe_intermediate_size"] = cfg["intermediate_size"]
    elif arch == "llama":
        if not cfg["num_experts"]:
            raise CheckpointError("GGUF architecture 'llama' without experts is a dense Llama; moetier runs "
                                  "MoE models only (Mixtral-style llama GGUFs have llama.expert_count)")
        cfg["head_dim"] = k("rope.dimension_count") or cfg["head_dim"]
    elif arch == "deepseek2":
        _deepseek(cfg, k)
    elif arch == "glm4moe":
        _moe_common(cfg, k)
        cfg["num_hidden_layers"] -= k("nextn_predict_layers", 0)
        cfg["partial_rotary_factor"] = k("rope.dimension_count", cfg["head_dim"] // 2) / cfg["head_dim"]
        cfg["use_qk_norm"] = "blk.0.attn_q_norm.weight" in names
    elif arch == "qwen3next":
        _qwen3_next(cfg, k, names, meta.get("qwen3next.attention.recurrent_layers"))
    elif arch == "gpt-oss":
        cfg["intermediate_size"] = cfg["moe_intermediate_size"]
        cfg["sliding_window"] = k("attention.sliding_window")
        cfg["attention_bias"] = True
        cfg["swiglu_limit"] = 7.0      # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE: alpha 1.702, limit 7 (not stored)
        if scaling:
            scaling.setdefault("beta_fast", 32.0)
            scaling.setdefault("beta_slow", 1.0)
            scaling["truncate"] = False   # gpt-oss's YaRN keeps the fractional correction range
    return {key: v for key, v in cfg.items() if v is not None}


def _moe_common(cfg: dict, k) -> None:
    """DeepSeek-style routing keys shared by deepseek2 and glm4moe."""
    cfg["first_k_dense_replace"] = k("leading_dense_block_count", 0)
    cfg["n_shared_experts"] = k("expert_shared_count", 0)
    cfg["routed_scaling_factor"] = k("expert_weights_scale", 1.0)
    cfg["norm_topk_prob"] = bool(k("expert_weights_norm", False))
    cfg["n_group"] = k("expert_group_count", 1)
    cfg["topk_group"] = k("expert_group_used_count", 1)
    if k("expert_gating_func", 2) != 2:
        raise CheckpointError("this GGUF routes experts with softmax (DeepSeek-V2 style); moetier's "
                              "deepseek_v3 / glm4_moe implement sigmoid routing only")


def _qwen3_next(cfg: dict, k, names: set, recurrent: list | None) -> None:
    n = cfg["num_hidden_layers"] - k("nextn_predict_layers", 0)   # MTP blocks are appended as layers
    cfg["num_hidden_layers"] = n
    cfg["norm_topk_prob"] = True   # llama.cpp always renormalises Qwen3-Next's top-k weights
    cfg["shared_expert_intermediate_size"] = k("expert_shared_feed_forward_length")
    cfg["partial_rotary_factor"] = k("rope.dimension_count", cfg["head_dim"] // 4) / cfg["head_dim"]
    cfg["linear_conv_kernel_dim"] = k("ssm.conv_kernel")
    cfg["linear_key_head_dim"] = k("ssm.state_size")
    cfg["linear_num_key_heads"] = k("ssm.group_count")
    cfg["linear_num_value_heads"] = k("ssm.time_step_rank")
    cfg["linear_value_head_dim"] = k("ssm.inner_size") // k("ssm.time_step_rank")
    if recurrent:
        cfg["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent[:n]]
    else:
        cfg["full_attention_interval"] = k("full_attention_interval", 4)
    if names:
        cfg["mlp_only_layers"] = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in names]


def _deepseek(cfg: dict, k) -> None:
    _moe_common(cfg, k)
    rope_dim = k("rope.dimension_count")
    key_len = k("attention.key_length_mla") or k("attention.key_length")
    cfg["qk_rope_head_dim"] = rope_dim
    cfg["qk_nope_head_dim"] = key_len - rope_dim
    cfg["v_head_dim"] = k("attention.value_length_mla") or k("attention.value_length")
    cfg["kv_lora_rank"] = k("attention.kv_lora_rank")
    cfg["q_lora_rank"] = k("attention.q_lora_rank")
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]    # MLA is stored as MQA; ours is per head
    cfg["head_dim"] = key_len
    if "rope_scaling" in cfg and k("rope.scaling.yarn_log_multiplier"):
        # the converter writes 0.1 * mscale_all_dim; llama.cpp takes mscale = mscale_all_dim (so the
        # cos/sin scale is 1), as the released DeepSeek-V3 / Kimi-K2 configs have it
        m = float(f"{k('rope.scaling.yarn_log_multiplier') / 0.1:.6g}")
        cfg["rope_scaling"].update(mscale=m, mscale_all_dim=m)


def _rope_scaling(k) -> dict | None:
    kind = k("rope.scaling.type")
    if kind in (None, "none") or not k("rope.scaling.factor"):
        return None
    sc = {"rope_type": kind, "factor": float(k("rope.scaling.factor"))}
    if k("rope.scaling.original_context_length"):
        sc["original_max_position_embeddings"] = k("rope.scaling.original_context_length")
    for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                         ("attention_factor", "yarn_attn_factor")):
        if k(f"rope.scaling.{theirs}"):
            sc[ours] = float(k(f"rope.scaling.{theirs}"))
    return sc


# ---------------------------------------------------------------- config -> metadata (moetier quantize)


def gguf_metadata(args, arch: Arch) -> dict:
    """ModelArgs -> {`{arch}.key` or general key: value}, the keys llama.cpp's converter writes.
    Python ints become UINT32, floats FLOAT32, bools BOOL (llama.cpp checks the types)."""
    a = arch.gguf
    rp = args.rope_parameters
    m = {
        "block_count": args.num_hidden_layers, "context_length": args.max_position_embeddings,
        "embedding_length": args.hidden_size, "feed_forward_length": args.intermediate_size,
        "attention.head_count": args.num_attention_heads, "attention.head_count_kv": args.num_key_value_heads,
        "rope.freq_base": float(args.rope_theta), "attention.layer_norm_rms_epsilon": float(args.rms_norm_eps),
        "attention.key_length": args.head_dim, "attention.value_length": args.head_dim,
        "expert_count": args.num_experts, "expert_used_count": args.num_experts_per_tok,
        "vocab_size": args.vocab_size,
    }
    if args.moe_intermediate_size:
        m["expert_feed_forward_length"] = args.moe_intermediate_size
    kind = rp.get("rope_type", "default")
    if kind in ("linear", "yarn") and rp.get("factor"):
        m["rope.scaling.type"] = kind
        m["rope.scaling.factor"] = float(rp["factor"])
        if kind == "yarn":
            m["rope.scaling.original_context_length"] = int(rp["original_max_position_embeddings"])
            for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                                 ("attention_factor", "yarn_attn_factor")):
                if rp.get(ours) is not None:
                    m[f"rope.scaling.{theirs}"] = float(rp[ours])
    if a == "llama":
        m["rope.dimension_count"] = args.head_dim
    elif a == "olmoe":
        m.pop("expert_feed_forward_length", None)
    elif a in ("deepseek2", "glm4moe"):
        m.update({"leading_dense_block_count": int(args.get("first_k_dense_replace") or 0),
                  "expert_shared_count": args.num_shared_experts, "expert_gating_func": 2,
                  "expert_weights_scale": float(args.get("routed_scaling_factor", 1.0)),
                  "expert_weights_norm": bool(args.norm_topk_prob),
                  "expert_group_count": int(args.get("n_group") or 1),
                  "expert_group_used_count": int(args.get("topk_group") or 1)})
    if a == "deepseek2":
        rank, dr = args.get("kv_lora_rank"), args.get("qk_rope_head_dim")
        dn, dv = args.get("qk_nope_head_dim"), args.get("v_head_dim")
        m.update({"attention.head_count_kv": 1, "attention.kv_lora_rank": rank, "rope.dimension_count": dr,
                  "attention.key_length": rank + dr, "attention.value_length": rank,
                  "attention.key_length_mla": dn + dr, "attention.value_length_mla": dv})
        if args.get("q_lora_rank"):
            m["attention.q_lora_rank"] = args.get("q_lora_rank")
        if rp.get("mscale_all_dim"):
            m["rope.scaling.yarn_log_multiplier"] = 0.1 * float(rp["mscale_all_dim"])
    elif a == "glm4moe":
        factor = rp.get("partial_rotary_factor", args.get("partial_rotary_factor", 0.5))
        m["rope.dimension_count"] = int(args.head_dim * factor)
    elif a == "qwen3next":
        every, hv = args.get("full_attention_interval", 4), args.get("linear_num_value_heads")
        types = args.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                            for i in range(args.num_hidden_layers)]
        factor = rp.get("partial_rotary_factor", args.get("partial_rotary_factor", 0.25))
        m.update({"expert_shared_feed_forward_length": args.get("shared_expert_intermediate_size"),
                  "ssm.conv_kernel": args.get("linear_conv_kernel_dim", 4),
                  "ssm.state_size": args.get("linear_key_head_dim"), "ssm.group_count": args.get("linear_num_key_heads"),
                  "ssm.time_step_rank": hv, "ssm.inner_size": hv * args.get("linear_value_head_dim"),
                  "attention.recurrent_layers": [t == "linear_attention" for t in types],
                  "full_attention_interval": every, "rope.dimension_count": int(args.head_dim * factor)})
    elif a == "gpt-oss":
        m["expert_feed_forward_length"] = args.intermediate_size
        if args.sliding_window:
            m["attention.sliding_window"] = args.sliding_window
    return {f"{a}.{k}": v for k, v in m.items() if v is not None}


def gguf_tensors(name: str, arch: Arch):
    """Our parameter name -> (Tensor spec, GGUF prefix) or ("experts", GGUF names) or None."""
    import re
    if name in GLOBAL:
        return GLOBAL[name], ""
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    if not m:
        return None
    layer, rest = m[1], m[2]
    ex = re.match(r"^" + re.escape(arch.experts_prefix) + r"\.experts\.([A-Za-z_]+)$", rest)
    if ex and ex[1] in arch.experts:
        return "experts", [f"blk.{layer}.{p}" for p in arch.experts[ex[1]]]
    spec = arch.layer.get(rest)
    if spec is None:
        return None
    return (spec[0] if isinstance(spec, list) else spec), f"blk.{layer}."
