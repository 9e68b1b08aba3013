"""GGUF checkpoints without llama.cpp: `moetier quantize` writes them (llama.cpp's names, metadata and
tokenizer keys), moetier loads them back. F32 must equal the safetensors directory exactly, for
every architecture's name table (including the Q/K permutation of llama and DeepSeek's split kv_b)."""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import numpy as np
import torch

from helpers import max_rel_err, ours_logits, tiny_checkpoint
from moetier.commands.quantize import quantize
from moetier.errors import CheckpointError
from moetier.weights.loader import load_model

TEXT = ["The quick brown fox jumps over the lazy dog.", "Python is a programming language.",
        "Mixture-of-experts models route each token to a few experts.", "Déjà vu: naïve café, 東京, emoji 🙂 and ₿.",
        "def f(x):\n    return x * 2  # comment", "Numbers 12345 and 3.14159, dates 2026-11-30."]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def build_tokenizer(directory: Path, regexes: list[str] | None = None, vocab_size: int = 300,
                    specials: tuple[str, ...] = ()) -> None:
    """A trained byte-level BPE (Qwen2's pre-tokenizer regex unless `regexes`) + tokenizer_config.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from moetier.weights.gguf_tokenizer import QWEN2
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in (regexes or [QWEN2])]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(TEXT * 20, trainer)
    tk.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "add_bos_token": False, "chat_template": CHATML}))


def qwen3_moe_config(**kw):
    from transformers import Qwen3MoeConfig
    base = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, max_position_embeddings=512, eos_token_id=2, rope_theta=10000.0)
    base.update(kw)
    return Qwen3MoeConfig(**base)


def sharpen(model):
    """lm_head x8: peaked next-token distributions (median top-1 p ~0.2), as trained models have."""
    model.lm_head.weight.mul_(8.0)


def build_qwen3_moe(directory: Path, scale: float = 4.0, init=None, **kw) -> Path:
    from transformers import Qwen3MoeForCausalLM
    directory.mkdir(parents=True, exist_ok=True)
    tiny_checkpoint(directory, Qwen3MoeForCausalLM, qwen3_moe_config(**kw), scale=scale, init=init)
    build_tokenizer(directory)
    return directory


def other_arch(name: str, directory: Path) -> Path:
    """A tiny random checkpoint of another architecture (its test module's config, vocab 320)."""
    mod = importlib.import_module(f"test_arch_{name}")
    hf = {"mixtral": "MixtralForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
          "gpt_oss": "GptOssForCausalLM", "olmoe": "OlmoeForCausalLM"}[name]
    import transformers
    init = getattr(mod, "random_correction_bias", None)
    kw = {"vocab_size": 320}
    if name == "deepseek_v3":   # GGUF keeps one YaRN mscale; llama.cpp reads it as mscale = mscale_all_dim
        kw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 64, "mscale": 0.8, "mscale_all_dim": 0.8}
    if name == "gpt_oss":       # llama.cpp's gpt-oss SwiGLU clamp is fixed at 7 (not in the metadata)
        kw["swiglu_limit"] = 7.0
    tiny_checkpoint(directory, getattr(transformers, hf), mod.config(**kw), scale=4.0, init=init)
    # llama.cpp's GLM vocab setup looks these up by name
    build_tokenizer(directory, specials=("[gMASK]", "<|user|>", "<|observation|>") if name == "glm4_moe" else ())
    return directory


def logits_of(path, tokens):
    model, args, _ = load_model(path)
    return ours_logits(model, tokens, 7), args


TOKENS = torch.randint(0, 300, (13,), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_qwen3_moe(tmp_path_factory.mktemp("gguf_qwen3_moe") / "model")


def test_f32_gguf_equals_safetensors(qwen_dir, tmp_path):
    out = quantize(qwen_dir, "F32", tmp_path / "m.gguf")
    want, args_st = logits_of(qwen_dir, TOKENS)
    got, args = logits_of(out, TOKENS)
    assert torch.equal(got, want)
    assert args.model_type == "qwen3_moe" and args.num_experts == 8 and args.moe_intermediate_size == 32
    assert args.rms_norm_eps == args_st.rms_norm_eps and args.eos_token_id == [2]


@pytest.mark.parametrize("qtype,tol", [("BF16", 2e-2), ("F16", 2e-3)])
def test_half_gguf_close(qwen_dir, tmp_path, qtype, tol):
    out = quantize(qwen_dir, qtype, tmp_path / "m.gguf")
    want, _ = logits_of(qwen_dir, TOKENS)
    got, _ = logits_of(out, TOKENS)
    assert max_rel_err(got, want) <= tol


def test_expert_access_is_per_expert_and_raw(qwen_dir, tmp_path):
    from moetier.weights.gguf import dequantize
    for qtype in ("F32", "Q8_0"):
        _, _, ckpt = load_model(quantize(qwen_dir, qtype, tmp_path / f"m-{qtype}.gguf"))
        prefix = "model.layers.1.mlp"
        stacked = ckpt.fused_tensor(prefix, "gate_up_proj")
        assert stacked.shape == (8, 64, 64)
        for e in (0, 5):
            one = ckpt.expert_tensor(prefix, "gate_up_proj", e)
            assert torch.equal(one, stacked[e])
            raw, q, shape = ckpt.expert_raw(prefix, "gate_up_proj", e)
            assert raw.dtype == torch.uint8 and shape == (64, 64) and q == (0 if qtype == "F32" else 8)
            assert torch.equal(dequantize(raw.contiguous(), q, shape) if q else raw.view(torch.float32), one)
            raw, q, shape = ckpt.expert_raw(prefix, "down_proj", e)
            assert shape == (64, 32) and raw.shape[0] == 64


def test_split_gguf(qwen_dir, tmp_path):
    first = quantize(qwen_dir, "F32", tmp_path / "m.gguf", split_max_tensors=8)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) >= 3 and first == parts[0]
    want, _ = logits_of(qwen_dir, TOKENS)
    got, _ = logits_of(parts[-1], TOKENS)          # any part names the set
    assert torch.equal(got, want)
    parts[1].unlink()
    with pytest.raises(CheckpointError, match="lacks"):
        load_model(first)


def test_gguf_to_gguf_requantize(qwen_dir, tmp_path):
    f32 = quantize(qwen_dir, "F32", tmp_path / "m.gguf")
    q8 = quantize(f32, "Q8_0", tmp_path / "m-q8.gguf")
    direct = quantize(qwen_dir, "Q8_0", tmp_path / "direct-q8.gguf")
    a, _ = logits_of(q8, TOKENS)
    b, _ = logits_of(direct, TOKENS)
    assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "glm4_moe", "gpt_oss", "olmoe"])
def test_other_architectures_roundtrip(arch, tmp_path):
    """Each GGUF name table both ways: HF -> GGUF (llama.cpp's layout) -> moetier equals the HF directory."""
    try:
        importlib.import_module(f"moetier.models.{arch}")
        importlib.import_module(f"test_arch_{arch}")
    except ImportError:
        pytest.skip(f"moetier.models.{arch} is not there yet")
    d = other_arch(arch, tmp_path / "model")
    out = quantize(d, "F32", tmp_path / "m.gguf")
    want, _ = logits_of(d, TOKENS)
    got, _ = logits_of(out, TOKENS)
    assert max_rel_err(got, want) <= 1e-6


def tensor_type(name, shape, ftype, n_layer, n_expert, names=(), **kw):
    from moetier.quant.mixes import Mix
    return Mix(ftype, n_layer, n_expert, names=[*names, name, "output.weight"], **kw).tensor_type(name, shape)


def test_mix_types_follow_llama_cpp():
    n = 48
    assert tensor_type("output.weight", (320, 256), "Q4_K_M", n, 128) == "Q6_K"
    assert tensor_type("blk.0.ffn_down_exps.weight", (128, 256, 768), "Q4_K_M", n, 128) == "Q6_K"
    assert tensor_type("blk.7.ffn_down_exps.weight", (128, 256, 768), "Q4_K_M", n, 128) == "Q4_K"
    assert tensor_type("blk.7.ffn_gate_exps.weight", (128, 768, 256), "Q4_K_M", n, 128) == "Q4_K"
    assert tensor_type("blk.7.attn_v.weight", (512, 256), "Q4_K_M", n, 8) == "Q8_0"
    assert tensor_type("blk.7.ffn_gate_inp.weight", (128, 256), "Q4_K_M", n, 128) == "F32"
    assert tensor_type("blk.7.attn_norm.weight", (256,), "Q8_0", n, 128) == "F32"
    # rows that 256 does not divide fall back as llama.cpp does: Q4_K -> Q5_0, then F16
    assert tensor_type("blk.7.ffn_up_exps.weight", (8, 32, 64), "Q4_K_M", n, 8) == "Q5_0"
    assert tensor_type("blk.7.ffn_up_exps.weight", (8, 32, 48), "Q4_K_M", n, 8) == "F16"


@pytest.mark.parametrize("ftype,name,shape,want", [
    # llama-quantize's Qwen3-30B-A3B files (48 layers, 128 experts, 32 / 4 heads): the tensors the mixes move
    ("Q4_0", "output.weight", (151936, 2048), "Q6_K"), ("Q4_0", "token_embd.weight", (151936, 2048), "Q4_0"),
    ("Q3_K_M", "blk.2.ffn_down_exps.weight", (128, 2048, 768), "Q5_K"),
    ("Q3_K_M", "blk.3.ffn_down_exps.weight", (128, 2048, 768), "Q4_K"),
    ("Q3_K_M", "blk.1.attn_v.weight", (512, 2048), "Q5_K"), ("Q3_K_M", "blk.2.attn_v.weight", (512, 2048), "Q4_K"),
    ("Q3_K_M", "blk.9.attn_output.weight", (2048, 4096), "Q4_K"),
    ("Q2_K", "blk.9.ffn_down_exps.weight", (128, 2048, 768), "Q3_K"),
    ("Q2_K", "blk.9.attn_v.weight", (512, 2048), "Q4_K"),
    ("IQ3_XXS", "blk.9.attn_q.weight", (4096, 2048), "IQ2_S"),
    ("IQ3_XXS", "token_embd.weight", (151936, 2048), "IQ3_S"),
    ("IQ3_XXS", "blk.5.ffn_down_exps.weight", (128, 2048, 768), "Q4_K"),
    ("IQ3_XXS", "blk.6.ffn_down_exps.weight", (128, 2048, 768), "Q3_K"),
    ("IQ3_XXS", "output.weight", (151936, 2048), "Q5_K"),
    ("IQ2_XXS", "blk.5.ffn_down_exps.weight", (128, 2048, 768), "Q2_K"),
    ("IQ2_XXS", "blk.6.ffn_down_exps.weight", (128, 2048, 768), "IQ2_XXS"),
    ("IQ1_M", "blk.9.attn_output.weight", (2048, 4096), "IQ2_XXS"),
    ("IQ1_M", "token_embd.weight", (151936, 2048), "Q2_K"),
    ("IQ3_M", "blk.9.attn_v.weight", (512, 2048), "Q4_K"),
    ("IQ3_M", "blk.9.ffn_up_exps.weight", (128, 768, 2048), "IQ3_S"),
    ("MXFP4_MOE", "blk.9.ffn_up_exps.weight", (128, 768, 2048), "MXFP4"),
    ("MXFP4_MOE", "blk.9.attn_q.weight", (4096, 2048), "Q8_0"), ("MXFP4_MOE", "output.weight", (151936, 2048), "Q8_0"),
])
def test_file_type_mixes(ftype, name, shape, want):
    names = [f"blk.{i}.{t}.weight" for i in range(48) for t in ("attn_v", "ffn_down_exps")]
    assert tensor_type(name, shape, ftype, 48, 128, names, n_gqa=8) == want


def test_imatrix_changes_the_mix_and_the_low_bit_types_need_one(qwen_dir, tmp_path):
    """An importance matrix (llama.cpp's GGUF form, written here) reaches the quantizer per expert; IQ2_XXS refuses to
    run without one; with one, the file loads and its Q4_0 rows differ from the reference quantizer's."""
    pytest.importorskip("libgguf")
    import gguf
    from moetier.errors import UserError
    from moetier.weights.gguf import GGUFFile
    d = build_qwen3_moe(tmp_path / "wide", hidden_size=256, moe_intermediate_size=256, intermediate_size=256,
                        num_attention_heads=4, head_dim=64)
    with pytest.raises(UserError, match="needs an importance matrix"):
        quantize(d, "IQ2_XXS", tmp_path / "no.gguf")
    plain = GGUFFile(quantize(d, "Q4_0", tmp_path / "plain.gguf"))
    g = np.random.default_rng(0)
    w = gguf.GGUFWriter(tmp_path / "imatrix.gguf", "imatrix")
    w.add_type("imatrix")
    for n in plain.keys():
        shape = plain.shape(n)
        if len(shape) >= 2 and "norm" not in n and "gate_inp" not in n:
            mats = shape[0] if len(shape) == 3 else 1
            w.add_tensor(n + ".in_sum2", (g.random((mats, shape[-1])) * 10 + 0.1).astype(np.float32))
            w.add_tensor(n + ".counts", np.full((mats, 1), 10.0, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    weighted = GGUFFile(quantize(d, "Q4_0", tmp_path / "weighted.gguf", imatrix=tmp_path / "imatrix.gguf"))
    name = "blk.0.ffn_gate_exps.weight"
    assert weighted.qtype(name) == plain.qtype(name) == 2
    assert not torch.equal(weighted.raw(name), plain.raw(name))
    assert (weighted.tensor(name) - plain.tensor(name)).abs().max() < 0.5 * plain.tensor(name).abs().max()
    iq2 = GGUFFile(quantize(d, "IQ2_XXS", tmp_path / "iq2.gguf", imatrix=tmp_path / "imatrix.gguf"))
    assert iq2.qtype("blk.1.ffn_up_exps.weight") == 16 and iq2.qtype("blk.0.attn_v.weight") == 12  # IQ2_XXS, Q4_K


def test_k_quant_mix_loads(qwen_dir, tmp_path):
    pytest.importorskip("libgguf")
    d = build_qwen3_moe(tmp_path / "wide", hidden_size=256, moe_intermediate_size=256, intermediate_size=256,
                        num_attention_heads=4, head_dim=64)
    out = quantize(d, "Q4_K_M", tmp_path / "m.gguf")
    from moetier.weights.gguf import GGUFFile
    g = GGUFFile(out)
    kinds = {n: g.qtype(n) for n in g.keys()}
    # 2 layers: llama.cpp's use_more_bits picks the last layer (7n/8) for Q6_K ffn_down
    assert kinds["blk.0.ffn_gate_exps.weight"] == 12 and kinds["blk.1.ffn_down_exps.weight"] == 14  # Q4_K, Q6_K
    assert kinds["blk.0.ffn_down_exps.weight"] == 12
    assert kinds["output.weight"] == 14 and kinds["blk.0.ffn_gate_inp.weight"] == 0
    want, _ = logits_of(d, TOKENS)
    got, _ = logits_of(out, TOKENS)
    assert max_rel_err(got, want) < 0.5   # 4-bit: close, not equal


def test_errors_name_the_problem(qwen_dir, tmp_path):
    import gguf
    w = gguf.GGUFWriter(tmp_path / "x.gguf", "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="'mamba' is not supported"):
        load_model(tmp_path / "x.gguf")
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        load_model(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    data = bytearray(quantize(qwen_dir, "F32", tmp_path / "m.gguf").read_bytes())
    i = data.find(b"token_embd.weight") + len(b"token_embd.weight")
    data[i + 4 + 2 * 8:i + 4 + 2 * 8 + 4] = (77).to_bytes(4, "little")   # n_dims u32, 2 dims u64, type u32
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="bad.gguf"):
        load_model(bad)


@pytest.mark.parametrize("qtype", ["Q3_K", "IQ3_XXS", "IQ4_NL"])
def test_threaded_quantizer_writes_the_serial_bytes(qtype):
    """`moetier quantize --threads`: ggml's quantizers on row chunks (experts with an importance matrix each) in
    threads give the serial result byte for byte."""
    pytest.importorskip("libgguf")
    from moetier.commands.quantize import encode
    g = torch.Generator().manual_seed(5)
    for shape in [(4, 40, 256), (37, 512)]:
        t = torch.randn(*shape, generator=g)
        imp = torch.rand((shape[0] if len(shape) == 3 else 1) * shape[-1], generator=g).numpy() + 0.1
        for importance in (None, imp):
            one, many = encode(t, qtype, importance, threads=1), encode(t, qtype, importance, threads=3)
            assert one.shape == many.shape and np.array_equal(one, many)
