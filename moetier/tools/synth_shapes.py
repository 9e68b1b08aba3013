"""The shapes `moetier synth` can write: public config.json values of six MoE models, how to
shrink them (--layers, --scale), and the tensor list of each as a Hugging Face checkpoint and as a
llama.cpp GGUF file. Shapes are torch's ([out, in]; GGUF's dims are the reverse).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from ..errors import UserError

# config.json of the public checkpoints, as published on the Hugging Face hub (fields that shape the
# model and its routing; quantization_config dropped: we write BF16 or GGUF). Layer counts exclude
# the multi-token-prediction layers (DeepSeek-V3 and GLM-4.5-Air ship one more layer; not written).
#
# | name            | repo                      | D    | layers | experts (k) | moe I | heads/kv | vocab  |
# | qwen3-30b-a3b   | Qwen/Qwen3-30B-A3B        | 2048 | 48     | 128 (8)     | 768   | 32/4     | 151936 |
# | qwen3-235b-a22b | Qwen/Qwen3-235B-A22B      | 4096 | 94     | 128 (8)     | 1536  | 64/4     | 151936 |
# | gpt-oss-120b    | openai/gpt-oss-120b       | 2880 | 36     | 128 (4)     | 2880  | 64/8     | 201088 |
# | deepseek-v3     | deepseek-ai/DeepSeek-V3   | 7168 | 61     | 256 (8) +1  | 2048  | 128 MLA  | 129280 |
# | glm-4.5-air     | zai-org/GLM-4.5-Air       | 4096 | 46     | 128 (8) +1  | 1408  | 96/8     | 151552 |
# | qwen3-next-80b-a3b | Qwen/Qwen3-Next-80B-A3B-Instruct | 2048 | 48 | 512 (10) +1 | 512 | 16/2 | 151936 |
# Qwen3-Next: 3 gated DeltaNet layers then 1 gated attention layer (full_attention_interval 4); DeltaNet
# 16 key / 32 value heads of 128, conv 4. transformers' Qwen3NextConfig defaults match except
# intermediate_size 5632 (unused: every layer is MoE), rope_theta 1e4 and max_position_embeddings 32768.
_QWEN3 = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", attention_bias=False,
              attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645, decoder_sparse_step=1,
              head_dim=128, hidden_act="silu", initializer_range=0.02, max_position_embeddings=40960,
              mlp_only_layers=[], norm_topk_prob=True, num_experts_per_tok=8, num_experts=128,
              output_router_logits=False, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000.0,
              router_aux_loss_coef=0.001, sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16",
              use_cache=True, use_sliding_window=False, vocab_size=151936)

SHAPES: dict[str, dict] = {
    "qwen3-30b-a3b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "max_window_layers": 48,
                      "moe_intermediate_size": 768, "num_attention_heads": 32, "num_hidden_layers": 48,
                      "num_key_value_heads": 4},
    "qwen3-235b-a22b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "max_window_layers": 94,
                        "moe_intermediate_size": 1536, "num_attention_heads": 64, "num_hidden_layers": 94,
                        "num_key_value_heads": 4},
    "gpt-oss-120b": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=True, attention_dropout=0.0,
        eos_token_id=200002, pad_token_id=199999, experts_per_token=4, head_dim=64, hidden_act="silu",
        hidden_size=2880, initial_context_length=4096, initializer_range=0.02, intermediate_size=2880,
        layer_types=["sliding_attention", "full_attention"] * 18, max_position_embeddings=131072,
        num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=36, num_key_value_heads=8,
        num_local_experts=128, output_router_logits=False, rms_norm_eps=1e-5,
        rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                      "rope_type": "yarn", "truncate": False},
        rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0,
        tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True, vocab_size=201088),
    "deepseek-v3": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", attention_bias=False,
        attention_dropout=0.0, aux_loss_alpha=0.001, bos_token_id=0, eos_token_id=1, ep_size=1,
        first_k_dense_replace=3, hidden_act="silu", hidden_size=7168, initializer_range=0.02,
        intermediate_size=18432, kv_lora_rank=512, max_position_embeddings=163840, moe_intermediate_size=2048,
        moe_layer_freq=1, n_group=8, n_routed_experts=256, n_shared_experts=1, norm_topk_prob=True,
        num_attention_heads=128, num_experts_per_tok=8, num_hidden_layers=61, num_key_value_heads=128,
        num_nextn_predict_layers=1, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        rms_norm_eps=1e-6,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096, "type": "yarn"},
        rope_theta=10000, routed_scaling_factor=2.5, scoring_func="sigmoid", seq_aux=True,
        tie_word_embeddings=False, topk_group=4, topk_method="noaux_tc", torch_dtype="bfloat16",
        use_cache=True, v_head_dim=128, vocab_size=129280),
    "glm-4.5-air": dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", attention_bias=True, attention_dropout=0.0,
        pad_token_id=151329, eos_token_id=[151329, 151336, 151338], head_dim=128, hidden_act="silu",
        hidden_size=4096, partial_rotary_factor=0.5, initializer_range=0.02, intermediate_size=10944,
        max_position_embeddings=131072, moe_intermediate_size=1408, norm_topk_prob=True,
        num_attention_heads=96, n_group=1, topk_group=1, n_routed_experts=128, n_shared_experts=1,
        routed_scaling_factor=1.0, num_experts_per_tok=8, first_k_dense_replace=1, num_hidden_layers=46,
        num_key_value_heads=8, rms_norm_eps=1e-5, rope_scaling=None, rope_theta=1000000,
        num_nextn_predict_layers=1, tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True,
        use_qk_norm=False, vocab_size=151552),
    "qwen3-next-80b-a3b": dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", attention_bias=False, attention_dropout=0.0,
        bos_token_id=151643, eos_token_id=151645, decoder_sparse_step=1, full_attention_interval=4, head_dim=256,
        hidden_act="silu", hidden_size=2048, initializer_range=0.02, intermediate_size=5120,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_value_head_dim=128, max_position_embeddings=262144, mlp_only_layers=[], moe_intermediate_size=512,
        norm_topk_prob=True, num_attention_heads=16, num_experts=512, num_experts_per_tok=10, num_hidden_layers=48,
        num_key_value_heads=2, output_router_logits=False, partial_rotary_factor=0.25, rms_norm_eps=1e-6,
        rope_scaling=None, rope_theta=10000000, router_aux_loss_coef=0.001, shared_expert_intermediate_size=512,
        tie_word_embeddings=False, torch_dtype="bfloat16", use_cache=True, use_sliding_window=False,
        vocab_size=151936),
}
ALIASES = {"Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b", "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b",
           "openai/gpt-oss-120b": "gpt-oss-120b", "deepseek-ai/DeepSeek-V3": "deepseek-v3",
           "zai-org/GLM-4.5-Air": "glm-4.5-air", "Qwen/Qwen3-Next-80B-A3B-Instruct": "qwen3-next-80b-a3b",
           "qwen3-next": "qwen3-next-80b-a3b", "qwen3-30b": "qwen3-30b-a3b", "qwen3-235b": "qwen3-235b-a22b",
           "gpt-oss": "gpt-oss-120b", "deepseek": "deepseek-v3", "glm-air": "glm-4.5-air"}
# the keys under which each shape names its expert count / top-k (read back through these)
_EXPERTS_KEY = {"qwen3_moe": "num_experts", "gpt_oss": "num_local_experts", "deepseek_v3": "n_routed_experts",
                "glm4_moe": "n_routed_experts", "qwen3_next": "num_experts"}
_TOPK_KEYS = ("num_experts_per_tok", "experts_per_token")


def shape_names() -> list[str]:
    return list(SHAPES)


def base_config(name: str) -> dict:
    key = ALIASES.get(name, name).lower()
    if key not in SHAPES:
        raise UserError(f"unknown shape {name!r}; moetier synth knows: {', '.join(SHAPES)}")
    return copy.deepcopy(SHAPES[key])


def num_experts(cfg: dict) -> int:
    return cfg[_EXPERTS_KEY[cfg["model_type"]]]


def top_k(cfg: dict) -> int:
    return cfg["num_experts_per_tok"]


def dense_layers(cfg: dict) -> int:
    return cfg.get("first_k_dense_replace", 0)


def is_moe_layer(cfg: dict, i: int) -> bool:
    if cfg["model_type"] in ("qwen3_moe", "qwen3_next"):
        return i not in cfg.get("mlp_only_layers", []) and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0
    return i >= dense_layers(cfg)


def _r(x: float, mult: int, lo: int) -> int:
    return max(lo, int(round(x / mult)) * mult)


def shrink(cfg: dict, layers: int | None = None, scale: float | str | None = None) -> dict:
    """Keep `layers` layers (dense-first layers shrink so at least one MoE layer stays) and scale
    every width by `scale` ('tiny' = hidden size 64). Dims stay multiples of 32 so quant blocks fit."""
    cfg = copy.deepcopy(cfg)
    if layers is not None:
        if layers < 1:
            raise UserError(f"--layers must be >= 1 (got {layers})")
        n = min(layers, cfg["num_hidden_layers"])
        cfg["num_hidden_layers"] = n
        if "first_k_dense_replace" in cfg:
            cfg["first_k_dense_replace"] = min(cfg["first_k_dense_replace"], max(0, n - 1))
        if "layer_types" in cfg:
            cfg["layer_types"] = cfg["layer_types"][:n]
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = n
    if scale in (None, 1, 1.0, "1"):
        return cfg
    f = 64 / cfg["hidden_size"] if scale == "tiny" else float(scale)
    if not 0 < f <= 1:
        raise UserError(f"--scale must be in (0, 1] or 'tiny' (got {scale})")
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank",
                "shared_expert_intermediate_size"):
        if cfg.get(key):
            cfg[key] = _r(cfg[key] * f, 32, 32)
    for key in ("head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "linear_key_head_dim",
                "linear_value_head_dim"):
        if cfg.get(key):
            cfg[key] = _r(cfg[key] * f, 16, 16)
    if cfg.get("linear_num_key_heads"):   # DeltaNet: keep the value heads per key head (2 in Qwen3-Next)
        per = cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"]
        cfg["linear_num_key_heads"] = max(1, round(cfg["linear_num_key_heads"] * f))
        cfg["linear_num_value_heads"] = cfg["linear_num_key_heads"] * per
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    cfg["num_attention_heads"] = max(2, round(h * f))
    cfg["num_key_value_heads"] = cfg["num_attention_heads"] if kv == h else max(1, round(kv * f))
    while cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        cfg["num_key_value_heads"] -= 1
    k, groups = top_k(cfg), cfg.get("n_group", 1)
    e = max(4 * k, 32, round(num_experts(cfg) * f))   # enough experts for routing to mean something
    cfg[_EXPERTS_KEY[cfg["model_type"]]] = -(-e // groups) * groups
    cfg["vocab_size"] = _r(cfg["vocab_size"] * f, 32, 1024)
    _fit_token_ids(cfg)
    if cfg.get("sliding_window"):
        cfg["sliding_window"] = min(cfg["sliding_window"], 64)
    return cfg


def _fit_token_ids(cfg: dict) -> None:
    """Special token ids of a shrunk vocabulary: the same ones, moved to its top end."""
    v = cfg["vocab_size"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = cfg.get(key)
        if ids is None:
            continue
        lst = [ids] if isinstance(ids, int) else list(ids)
        lst = [i if i < v - 64 else v - 64 + (i % 64) for i in lst]
        cfg[key] = lst[0] if isinstance(ids, int) else lst


def special_ids(cfg: dict) -> list[int]:
    out = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = cfg.get(key)
        if ids is not None:
            out += [ids] if isinstance(ids, int) else list(ids)
    return sorted(set(out))


# ---------------------------------------------------------------- tensor lists
@dataclass(frozen=True)
class Spec:
    """One tensor to write. init: embed | lm_head | router | ones | zeros | w (std 1/sqrt(fan_in)) |
    out (residual branch output, scaled down) | bias (small). `layer` is set for routers."""
    name: str
    shape: tuple
    init: str
    fan_in: int = 1
    layer: int = -1
    f32: bool = False   # stored as float32 even in a BF16 checkpoint (as the real ones do)


def _dims(cfg: dict) -> dict:
    return dict(D=cfg["hidden_size"], H=cfg["num_attention_heads"], KV=cfg["num_key_value_heads"],
                hd=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                E=num_experts(cfg), I=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],  # gpt-oss: one size
                F=cfg.get("intermediate_size", 0),
                V=cfg["vocab_size"], S=cfg.get("n_shared_experts", 0))


def hf_tensors(cfg: dict) -> list[Spec]:
    """Tensor names and shapes as the public Hugging Face checkpoint stores them."""
    d = _dims(cfg)
    D, E, I, F = d["D"], d["E"], d["I"], d["F"]
    mt = cfg["model_type"]
    norm = "zeros" if mt == "qwen3_next" else "ones"      # Qwen3-Next's RMSNorms store w with x * (1 + w)
    out = [Spec("model.embed_tokens.weight", (d["V"], D), "embed")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.append(Spec(p + "input_layernorm.weight", (D,), norm))
        mixer = _qwen3_next_mixer(cfg, d, i, hf=True) if mt == "qwen3_next" else _attention(cfg, d, hf=True)
        out += [Spec(p + n, s, k, fi) for n, s, k, fi in mixer]
        out.append(Spec(p + "post_attention_layernorm.weight", (D,), norm))
        if not is_moe_layer(cfg, i):
            out += [Spec(p + "mlp.gate_proj.weight", (F, D), "w", D), Spec(p + "mlp.up_proj.weight", (F, D), "w", D),
                    Spec(p + "mlp.down_proj.weight", (D, F), "out", F)]
        elif mt == "gpt_oss":
            m = p + "mlp."
            out += [Spec(m + "router.weight", (E, D), "router", D, i), Spec(m + "router.bias", (E,), "zeros"),
                    Spec(m + "experts.gate_up_proj", (E, D, 2 * I), "w", D),
                    Spec(m + "experts.gate_up_proj_bias", (E, 2 * I), "bias"),
                    Spec(m + "experts.down_proj", (E, I, D), "out", I),
                    Spec(m + "experts.down_proj_bias", (E, D), "bias")]
        else:
            m = p + "mlp."
            out.append(Spec(m + "gate.weight", (E, D), "router", D, i))
            if mt in ("deepseek_v3", "glm4_moe"):
                out.append(Spec(m + "gate.e_score_correction_bias", (E,), "zeros", f32=True))
            for e in range(E):
                x = f"{m}experts.{e}."
                out += [Spec(x + "gate_proj.weight", (I, D), "w", D), Spec(x + "up_proj.weight", (I, D), "w", D),
                        Spec(x + "down_proj.weight", (D, I), "out", I)]
            if d["S"]:
                si = I * d["S"]
                x = m + "shared_experts."
                out += [Spec(x + "gate_proj.weight", (si, D), "w", D), Spec(x + "up_proj.weight", (si, D), "w", D),
                        Spec(x + "down_proj.weight", (D, si), "out", si)]
            if mt == "qwen3_next":
                out += [Spec(p + n, s, k, fi) for n, s, k, fi in _qwen3_next_shared(cfg, d, hf=True)]
    out += [Spec("model.norm.weight", (D,), norm), Spec("lm_head.weight", (d["V"], D), "lm_head")]
    return out


def _attention(cfg: dict, d: dict, hf: bool) -> list[tuple]:
    """(name, shape, init, fan_in) of one layer's attention, HF names if hf else GGUF names."""
    D, H, KV, hd = d["D"], d["H"], d["KV"], d["hd"]
    mt = cfg["model_type"]
    n = (lambda h, g: h) if hf else (lambda h, g: g)
    if mt == "deepseek_v3":
        ql, kvl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
        dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        out = [(n("self_attn.q_a_proj.weight", "attn_q_a.weight"), (ql, D), "w", D),
               (n("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"), (ql,), "ones", 1),
               (n("self_attn.q_b_proj.weight", "attn_q_b.weight"), (H * (dn + dr), ql), "w", ql),
               (n("self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"), (kvl + dr, D), "w", D),
               (n("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"), (kvl,), "ones", 1)]
        if hf:
            out.append(("self_attn.kv_b_proj.weight", (H * (dn + dv), kvl), "w", kvl))
        else:  # current convert_hf_to_gguf.py splits kv_b for the absorbed MLA: k_b transposed
            out += [("attn_k_b.weight", (H, kvl, dn), "w", kvl), ("attn_v_b.weight", (H, dv, kvl), "w", kvl)]
        return out + [(n("self_attn.o_proj.weight", "attn_output.weight"), (D, H * dv), "out", H * dv)]
    out = [(n("self_attn.q_proj.weight", "attn_q.weight"), (H * hd, D), "w", D),
           (n("self_attn.k_proj.weight", "attn_k.weight"), (KV * hd, D), "w", D),
           (n("self_attn.v_proj.weight", "attn_v.weight"), (KV * hd, D), "w", D),
           (n("self_attn.o_proj.weight", "attn_output.weight"), (D, H * hd), "out", H * hd)]
    if cfg.get("attention_bias"):
        out += [(n(f"self_attn.{p}_proj.bias", f"attn_{g}.bias"), (c,), "bias", 1)
                for p, g, c in (("q", "q", H * hd), ("k", "k", KV * hd), ("v", "v", KV * hd))]
        if mt == "gpt_oss":
            out.append((n("self_attn.o_proj.bias", "attn_output.bias"), (D,), "bias", 1))
    if mt == "qwen3_moe" or cfg.get("use_qk_norm"):
        out += [(n("self_attn.q_norm.weight", "attn_q_norm.weight"), (hd,), "ones", 1),
                (n("self_attn.k_norm.weight", "attn_k_norm.weight"), (hd,), "ones", 1)]
    if mt == "gpt_oss":
        out.append((n("self_attn.sinks", "attn_sinks.weight"), (H,), "zeros", 1))
    return out


def _qwen3_next_mixer(cfg: dict, d: dict, i: int, hf: bool) -> list[tuple]:
    """One Qwen3-Next layer's token mixer: gated attention every full_attention_interval-th layer,
    else gated DeltaNet. GGUF as convert_hf_to_gguf writes it: in_proj_qkvz split into attn_qkv +
    attn_gate, norms stored as 1 + w, A_log as ssm_a = -exp(A_log) (-1 for A_log = 0), conv [C, K]."""
    D, H, KV, hd = d["D"], d["H"], d["KV"], d["hd"]
    n = (lambda h, g: h) if hf else (lambda h, g: g)
    every = cfg.get("full_attention_interval", 4)
    types = cfg.get("layer_types")
    kind = types[i] if types else ("full_attention" if (i + 1) % every == 0 else "linear_attention")
    if kind == "full_attention":
        qn = "zeros" if hf else "ones"
        return [(n("self_attn.q_proj.weight", "attn_q.weight"), (2 * H * hd, D), "w", D),   # [query | gate]
                (n("self_attn.k_proj.weight", "attn_k.weight"), (KV * hd, D), "w", D),
                (n("self_attn.v_proj.weight", "attn_v.weight"), (KV * hd, D), "w", D),
                (n("self_attn.o_proj.weight", "attn_output.weight"), (D, H * hd), "out", H * hd),
                (n("self_attn.q_norm.weight", "attn_q_norm.weight"), (hd,), qn, 1),
                (n("self_attn.k_norm.weight", "attn_k_norm.weight"), (hd,), qn, 1)]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd, vd, kern = hk * cfg["linear_key_head_dim"], hv * cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    conv = 2 * kd + vd
    if hf:
        out = [("linear_attn.in_proj_qkvz.weight", (2 * kd + 2 * vd, D), "w", D),
               ("linear_attn.in_proj_ba.weight", (2 * hv, D), "w", D),
               ("linear_attn.conv1d.weight", (conv, 1, kern), "w", kern),
               ("linear_attn.dt_bias", (hv,), "ones", 1), ("linear_attn.A_log", (hv,), "zeros", 1)]
    else:
        out = [("attn_qkv.weight", (conv, D), "w", D), ("attn_gate.weight", (vd, D), "w", D),
               ("ssm_ba.weight", (2 * hv, D), "w", D), ("ssm_conv1d.weight", (conv, kern), "w", kern),
               ("ssm_dt.bias", (hv,), "ones", 1), ("ssm_a", (hv,), "neg_ones", 1)]
    return out + [(n("linear_attn.norm.weight", "ssm_norm.weight"), (cfg["linear_value_head_dim"],), "ones", 1),
                  (n("linear_attn.out_proj.weight", "ssm_out.weight"), (D, vd), "out", vd)]


def _qwen3_next_shared(cfg: dict, d: dict, hf: bool) -> list[tuple]:
    """The shared expert and its per-token sigmoid gate [1, D]."""
    D, si = d["D"], cfg["shared_expert_intermediate_size"]
    n = (lambda h, g: h) if hf else (lambda h, g: g)
    return [(n("mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"), (si, D), "w", D),
            (n("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"), (si, D), "w", D),
            (n("mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"), (D, si), "out", si),
            (n("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"), (1, D), "w", D)]


def gguf_tensors(cfg: dict) -> list[Spec]:
    """Tensor names and shapes as llama.cpp's convert_hf_to_gguf.py writes them (experts merged [E, ...])."""
    d = _dims(cfg)
    D, E, I, F = d["D"], d["E"], d["I"], d["F"]
    mt = cfg["model_type"]
    post_norm = "post_attention_norm.weight" if mt in ("gpt_oss", "glm4_moe", "qwen3_next") else "ffn_norm.weight"
    out = [Spec("token_embd.weight", (d["V"], D), "embed")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"blk.{i}."
        out.append(Spec(p + "attn_norm.weight", (D,), "ones"))
        mixer = _qwen3_next_mixer(cfg, d, i, hf=False) if mt == "qwen3_next" else _attention(cfg, d, hf=False)
        out += [Spec(p + n, s, k, fi) for n, s, k, fi in mixer]
        out.append(Spec(p + post_norm, (D,), "ones"))
        if not is_moe_layer(cfg, i):
            out += [Spec(p + "ffn_gate.weight", (F, D), "w", D), Spec(p + "ffn_up.weight", (F, D), "w", D),
                    Spec(p + "ffn_down.weight", (D, F), "out", F)]
            continue
        out.append(Spec(p + "ffn_gate_inp.weight", (E, D), "router", D, i))
        if mt == "gpt_oss":
            out.append(Spec(p + "ffn_gate_inp.bias", (E,), "zeros"))
        if mt in ("deepseek_v3", "glm4_moe"):
            out.append(Spec(p + "exp_probs_b.bias", (E,), "zeros"))
        out += [Spec(p + "ffn_gate_exps.weight", (E, I, D), "w", D), Spec(p + "ffn_up_exps.weight", (E, I, D), "w", D),
                Spec(p + "ffn_down_exps.weight", (E, D, I), "out", I)]
        if mt == "gpt_oss":
            out += [Spec(p + "ffn_gate_exps.bias", (E, I), "bias"), Spec(p + "ffn_up_exps.bias", (E, I), "bias"),
                    Spec(p + "ffn_down_exps.bias", (E, D), "bias")]
        if d["S"]:
            si = I * d["S"]
            out += [Spec(p + "ffn_gate_shexp.weight", (si, D), "w", D), Spec(p + "ffn_up_shexp.weight", (si, D), "w", D),
                    Spec(p + "ffn_down_shexp.weight", (D, si), "out", si)]
        if mt == "qwen3_next":
            out += [Spec(p + n, s, k, fi) for n, s, k, fi in _qwen3_next_shared(cfg, d, hf=False)]
    out += [Spec("output_norm.weight", (D,), "ones"), Spec("output.weight", (d["V"], D), "lm_head")]
    return out


GGUF_ARCH = {"qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss", "deepseek_v3": "deepseek2", "glm4_moe": "glm4moe",
             "qwen3_next": "qwen3next"}
TOKENIZER_PRE = {"qwen3_moe": "qwen2", "gpt_oss": "gpt-4o", "deepseek_v3": "deepseek-v3", "glm4_moe": "glm4",
                 "qwen3_next": "qwen2"}


def gguf_metadata(cfg: dict, name: str) -> dict:
    """llama.cpp's hyperparameter keys for the architecture (as convert_hf_to_gguf.py writes them)."""
    d = _dims(cfg)
    mt = cfg["model_type"]
    a = GGUF_ARCH[mt]
    rope = cfg.get("rope_scaling") or {}
    m = {"general.architecture": a, "general.name": f"moetier-synth {name}",
         f"{a}.block_count": cfg["num_hidden_layers"], f"{a}.context_length": cfg["max_position_embeddings"],
         f"{a}.embedding_length": d["D"], f"{a}.feed_forward_length": d["F"],
         f"{a}.attention.head_count": d["H"], f"{a}.attention.head_count_kv": d["KV"],
         f"{a}.rope.freq_base": float(cfg["rope_theta"]),
         f"{a}.attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
         f"{a}.expert_count": d["E"], f"{a}.expert_used_count": top_k(cfg),
         f"{a}.expert_feed_forward_length": d["I"], f"{a}.vocab_size": d["V"]}
    if mt in ("qwen3_moe", "gpt_oss", "glm4_moe", "qwen3_next"):
        m[f"{a}.attention.key_length"] = d["hd"]
        m[f"{a}.attention.value_length"] = d["hd"]
    if mt == "gpt_oss":
        m[f"{a}.feed_forward_length"] = d["I"]
        m[f"{a}.attention.sliding_window"] = cfg["sliding_window"]
    if mt in ("deepseek_v3", "glm4_moe"):
        m.update({f"{a}.leading_dense_block_count": dense_layers(cfg), f"{a}.expert_shared_count": d["S"],
                  f"{a}.expert_weights_scale": float(cfg["routed_scaling_factor"]),
                  f"{a}.expert_weights_norm": bool(cfg["norm_topk_prob"]), f"{a}.expert_gating_func": 2,
                  f"{a}.expert_group_count": cfg.get("n_group", 1),
                  f"{a}.expert_group_used_count": cfg.get("topk_group", 1), f"{a}.nextn_predict_layers": 0})
    if mt == "qwen3_next":
        hv = cfg["linear_num_value_heads"]
        m.update({f"{a}.expert_shared_feed_forward_length": cfg["shared_expert_intermediate_size"],
                  f"{a}.ssm.conv_kernel": cfg["linear_conv_kernel_dim"], f"{a}.ssm.state_size": cfg["linear_key_head_dim"],
                  f"{a}.ssm.group_count": cfg["linear_num_key_heads"], f"{a}.ssm.time_step_rank": hv,
                  f"{a}.ssm.inner_size": hv * cfg["linear_value_head_dim"],
                  f"{a}.full_attention_interval": cfg.get("full_attention_interval", 4),
                  f"{a}.rope.dimension_count": int(d["hd"] * cfg.get("partial_rotary_factor", 0.25))})
    if mt == "glm4_moe":
        m[f"{a}.rope.dimension_count"] = int(d["hd"] * cfg.get("partial_rotary_factor", 1.0))
    if mt == "deepseek_v3":
        kvl, dr = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        m.update({f"{a}.attention.head_count_kv": 1, f"{a}.attention.q_lora_rank": cfg["q_lora_rank"],
                  f"{a}.attention.kv_lora_rank": kvl, f"{a}.attention.key_length": kvl + dr,
                  f"{a}.attention.value_length": kvl,
                  f"{a}.attention.key_length_mla": cfg["qk_nope_head_dim"] + dr,
                  f"{a}.attention.value_length_mla": cfg["v_head_dim"], f"{a}.rope.dimension_count": dr})
        if rope.get("mscale_all_dim"):
            m[f"{a}.rope.scaling.yarn_log_multiplier"] = 0.1 * float(rope["mscale_all_dim"])
    if rope.get("factor"):
        m.update({f"{a}.rope.scaling.type": rope.get("rope_type", rope.get("type", "yarn")),
                  f"{a}.rope.scaling.factor": float(rope["factor"]),
                  f"{a}.rope.scaling.original_context_length": rope["original_max_position_embeddings"]})
    return m
