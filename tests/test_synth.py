"""moetier synth: tiny same-architecture checkpoints of every listed shape load (moetier, transformers,
gguf-py), the quantizers match gguf-py, and the routing check sees spread (or says loudly it doesn't)."""
import importlib.util
import json
import warnings

import pytest
import torch

from moetier.cli import main as cli
from moetier.errors import UserError
from moetier.tools import synth_quant as q
from moetier.tools.synth import read_meta, stream_for, synth
from moetier.tools.synth_router import fit_offsets, route, zipf_targets
from moetier.tools.synth_shapes import (GGUF_ARCH, SHAPES, base_config, gguf_tensors, hf_tensors, num_experts,
                                        shrink, top_k)

gguf = pytest.importorskip("gguf")
SHAPE_NAMES = list(SHAPES)


def _quiet(*a):
    pass


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> (safetensors dir, Q8_0 GGUF path, reports), built once per shape."""
    root = tmp_path_factory.mktemp("synth")
    cache = {}

    def get(name):
        if name not in cache:
            st = synth(name, "BF16", root / name, layers=1, scale="tiny", seed=1, log=_quiet)
            gg = synth(name, "Q8_0", root / f"{name}.gguf", layers=1, scale="tiny", seed=1, log=_quiet)
            cache[name] = (root / name, root / f"{name}.gguf", st, gg)
        return cache[name]
    return get


@pytest.mark.parametrize("qtype", [q.Q8_0, q.Q4_0])
def test_quantizers_bit_identical_to_gguf_py(qtype):
    x = torch.randn(48, 256, generator=torch.Generator().manual_seed(qtype)) * 0.03
    x[3, :32] = 0.0                                   # an all-zero block
    want = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType(qtype))
    got = q.quantize(x, qtype).numpy()
    assert (got == want).all()
    back = q.dequantize(torch.from_numpy(got), qtype, x.shape)
    assert torch.equal(back, torch.from_numpy(gguf.quants.dequantize(want, gguf.GGMLQuantizationType(qtype))))


def test_q4_k_dequantizes_like_gguf_py_and_is_accurate():
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(3))
    raw = q.quantize(x, q.Q4_K)
    assert raw.shape == (16, 2 * 144)
    ref = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q4_K))
    assert torch.equal(q.dequantize(raw, q.Q4_K, x.shape), ref)
    step = (x.reshape(-1, 32).amax(-1) - x.reshape(-1, 32).amin(-1).clamp(max=0)) / 15
    err = (ref - x).abs().reshape(-1, 32).amax(-1)
    assert (err <= step * 0.75 + 1e-3).all()          # half a step, plus the 6-bit scale rounding


def test_pick_type_falls_back_when_rows_do_not_fit_blocks():
    assert q.pick_type(q.Q4_K, 2048) == q.Q4_K
    assert q.pick_type(q.Q4_K, 2880) == q.Q4_0        # gpt-oss hidden size
    assert q.pick_type(q.Q4_0, 48) == q.BF16


@pytest.mark.parametrize("name", SHAPE_NAMES)
def test_real_shapes_match_public_configs(name):
    cfg = base_config(name)
    params = sum(torch.Size(s.shape).numel() for s in hf_tensors(cfg)) / 1e9
    expected = {"qwen3-30b-a3b": 30.5, "qwen3-235b-a22b": 235.1, "gpt-oss-120b": 116.8, "deepseek-v3": 671.0,
                "glm-4.5-air": 106.9, "qwen3-next-80b-a3b": 79.7}[name]      # totals without the MTP layers
    assert abs(params - expected) / expected < 0.02, f"{name}: {params:.1f}B parameters, expected ~{expected}B"
    gg = {s.name: s.shape for s in gguf_tensors(cfg)}
    assert sum(torch.Size(s).numel() for s in gg.values()) / 1e9 == pytest.approx(params, rel=0.01)


@pytest.mark.parametrize("name", SHAPE_NAMES)
def test_safetensors_checkpoint_is_complete_and_loads(made, name):
    path = made(name)[0]
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "model.safetensors.index.json"):
        assert (path / f).exists(), f
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and read_meta(path)["seed"] == 1
    from moetier.weights.safetensors import Checkpoint
    ck = Checkpoint(path)
    for s in hf_tensors(shrink(base_config(name), 1, "tiny")):
        assert ck.shape(s.name) == s.shape, s.name
    from moetier.weights.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(path)
    assert tok.vocab_size == cfg["vocab_size"] and tok.decode(tok.encode("héllo")) == "héllo"
    if importlib.util.find_spec(f"moetier.models.{cfg['model_type']}") is None:
        pytest.skip(f"moetier has no {cfg['model_type']} model file yet")
    from moetier.runtime.generate import greedy_tokens
    from moetier.weights.loader import load_model
    model, _, _ = load_model(path)
    with torch.no_grad():
        toks = greedy_tokens(model, [1, 2, 3], 4)
    assert len(toks) == 4 and all(0 <= t < cfg["vocab_size"] for t in toks)


@pytest.mark.parametrize("name", SHAPE_NAMES)
def test_safetensors_names_are_what_transformers_expects(made, name):
    transformers = pytest.importorskip("transformers")
    path, _, _, _ = made(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ref, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                                          dtype=torch.float32)
        except ValueError as e:
            pytest.skip(f"this transformers cannot build {name}: {e}")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        # no cache: transformers' hybrid cache cannot size itself without an attention layer (Qwen3-Next, 1 layer)
        logits = ref(torch.tensor([[1, 2, 3, 4]]), use_cache=False).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.1


@pytest.mark.parametrize("name", SHAPE_NAMES)
def test_gguf_has_llama_cpp_names_shapes_and_metadata(made, name):
    _, path, _, rep = made(name)
    cfg = rep["config"]
    reader = gguf.GGUFReader(path)
    arch = GGUF_ARCH[cfg["model_type"]]
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == arch
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[next(a for a, n in gguf.MODEL_ARCH_NAMES.items()
                                                                   if n == arch)]}
    want = {s.name: s for s in gguf_tensors(cfg)}
    got = {t.name: t for t in reader.tensors}
    assert set(got) == set(want)
    for n, t in got.items():
        base = (n.rsplit(".", 1)[0] if n.endswith((".weight", ".bias")) else n).replace("blk.0.", "blk.{bid}.")
        assert base in known, f"{n} is not a llama.cpp tensor name for {arch}"
        assert tuple(int(x) for x in reversed(t.shape)) == want[n].shape, n
        expect = q.F32 if len(want[n].shape) == 1 or "ffn_gate_inp" in n else q.pick_type(q.Q8_0, want[n].shape[-1])
        assert int(t.tensor_type) == expect, n
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == cfg["vocab_size"]
    assert int(reader.fields[f"{arch}.expert_count"].parts[-1][0]) == num_experts(cfg)
    assert int(reader.fields[f"{arch}.expert_used_count"].parts[-1][0]) == top_k(cfg)


@pytest.mark.parametrize("name", SHAPE_NAMES)
def test_gguf_loads_in_moetier(made, name):
    _, path, rep, _ = made(name)
    try:
        from moetier.weights.gguf import is_gguf  # noqa: F401
    except ImportError:
        pytest.skip("moetier.weights.gguf is not there yet")
    if importlib.util.find_spec(f"moetier.models.{rep['config']['model_type']}") is None:
        pytest.skip(f"moetier has no {rep['config']['model_type']} model file yet")
    from moetier.runtime.generate import greedy_tokens
    from moetier.weights.loader import load_model
    model, args, _ = load_model(path)
    assert args.num_experts == num_experts(rep["config"])
    with torch.no_grad():
        assert len(greedy_tokens(model, [5, 6, 7], 3)) == 3


@pytest.mark.parametrize("name", SHAPE_NAMES)
def test_uniform_routing_is_spread(made, name):
    for rep in made(name)[2:]:
        r = rep["routing"]
        assert not r["problems"], r["problems"]
        E = r["experts"]
        for layer in r["layers"]:
            assert layer["distinct"] >= 0.75 * E
            assert layer["entropy"] > 0.8
            assert layer["top1_max_share"] < 0.35
            lru = layer["lru"]
            assert lru["10%"] <= lru["25%"] <= lru["50%"] <= lru["75%"] <= 1.0


def test_skew_follows_zipf():
    cfg = shrink(base_config("qwen3-30b-a3b"), 1, 0.5)   # 64 experts, top-8
    E, k = num_experts(cfg), top_k(cfg)
    target = zipf_targets(E, k, 0.5)
    assert target.sum() == pytest.approx(k) and (target[:-1] >= target[1:]).all()
    g = torch.Generator().manual_seed(0)
    off = fit_offsets(cfg, target, 0.87, g)
    ids = route(cfg, torch.randn(20000, E, generator=g) * 0.87 + off)
    pop = torch.bincount(ids.reshape(-1), minlength=E).float() / 20000
    assert (pop - target).abs().max() < 0.05
    assert pop[:8].sum() > 2 * pop[-8:].sum()


def test_collapsed_routing_fails_loudly(tmp_path, capsys):
    rc = cli(["synth", "qwen3-30b-a3b", "--quant", "BF16", "--out", str(tmp_path / "m"), "--layers", "1",
              "--scale", "tiny", "--skew", "2.5"])
    out = capsys.readouterr().out
    assert rc == 2 and "ROUTING SPREAD CHECK FAILED" in out and "the same 8 experts serve" in out


def test_shrink_keeps_a_moe_layer_and_block_sized_dims():
    cfg = shrink(base_config("deepseek-v3"), 2, "tiny")
    assert cfg["num_hidden_layers"] == 2 and cfg["first_k_dense_replace"] == 1
    assert num_experts(cfg) % cfg["n_group"] == 0 and num_experts(cfg) >= 4 * top_k(cfg)
    assert cfg["hidden_size"] % 32 == 0 and cfg["vocab_size"] > max(cfg["eos_token_id"], cfg["bos_token_id"])
    gpt = shrink(base_config("gpt-oss-120b"), 3, 0.1)
    assert gpt["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert gpt["num_attention_heads"] % gpt["num_key_value_heads"] == 0


def test_cli_json_and_q4_k(tmp_path, capsys):
    rc = cli(["synth", "qwen3-30b-a3b", "--quant", "Q4_K", "--out", str(tmp_path), "--layers", "1",
              "--scale", "0.125", "--skew", "0.4", "--json"])
    out = capsys.readouterr().out
    rep = json.loads(out)                                  # exactly one JSON object on stdout
    assert rc == 0 and rep["format"] == "gguf" and rep["path"].endswith("qwen3-30b-a3b-Q4_K.gguf")
    reader = gguf.GGUFReader(rep["path"])
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert rep["config"]["hidden_size"] == 256 and types["blk.0.ffn_gate_exps.weight"] == "Q4_K"
    assert types["blk.0.ffn_down_exps.weight"] == "Q4_0"  # rows of 96: not whole Q4_K blocks
    ids = stream_for(rep["path"], rep["config"]["vocab_size"], 200)
    assert len({i // read_meta(rep["path"])["topic_block"] for i in ids}) < 20   # topic-local prompts


def test_small_chunks_and_disk_space(tmp_path, monkeypatch):
    import moetier.tools.synth as synth_mod
    monkeypatch.setattr(synth_mod, "CHUNK_ELEMENTS", 1000)
    rep = synth("gpt-oss-120b", "Q4_0", tmp_path / "x.gguf", layers=1, scale="tiny", log=_quiet)
    assert 0 < rep["bytes"] < (tmp_path / "x.gguf").stat().st_size   # tensor data + header + padding
    assert gguf.GGUFReader(tmp_path / "x.gguf").tensors
    import shutil
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 30, 9 << 30, 1 << 30))
    with pytest.raises(UserError, match="--layers"):
        synth("qwen3-30b-a3b", "BF16", tmp_path / "big", log=_quiet)


def test_qwen3_next_layers_4_match_transformers_and_gguf(tmp_path):
    """4 layers hold 3 DeltaNet layers and 1 gated attention layer: moetier's logits equal transformers'
    on the safetensors and its own on a BF16 GGUF of the same weights (the converter's transforms)."""
    transformers = pytest.importorskip("transformers")
    st = synth("qwen3-next-80b-a3b", "BF16", tmp_path / "st", layers=4, scale="tiny", seed=2, log=_quiet)
    gg = synth("qwen3-next-80b-a3b", "BF16", tmp_path / "gg", layers=4, scale="tiny", seed=2, fmt="gguf", log=_quiet)
    assert not st["routing"]["problems"] and not gg["routing"]["problems"]
    from helpers import max_rel_err, ours_logits

    from moetier.weights.loader import load_model
    model, args, _ = load_model(st["path"])
    assert [b.linear for b in model.model.layers] == [True, True, True, False]
    tokens = torch.randint(0, args.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    got = ours_logits(model, tokens, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = transformers.AutoModelForCausalLM.from_pretrained(st["path"], dtype=torch.float32)
    with torch.no_grad():
        want = ref(tokens[None]).logits[0]
    assert max_rel_err(got, want) < 1e-4
    # the GGUF's weights are drawn per GGUF name (other values): check the converter's transforms instead
    model_gg, args_gg, _ = load_model(gg["path"])
    assert [b.linear for b in model_gg.model.layers] == [True, True, True, False]
    assert args_gg.extra["partial_rotary_factor"] == 0.25 and args_gg.num_experts == args.num_experts
    params = dict(model_gg.named_parameters())
    assert torch.equal(params["model.layers.0.linear_attn.A_log"], torch.zeros(2))    # ssm_a = -1
    assert torch.equal(params["model.layers.3.input_layernorm.weight"], torch.zeros(64))   # stored 1 + w
    assert torch.isfinite(ours_logits(model_gg, tokens, 8)).all()
