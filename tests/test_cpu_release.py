"""A CPU engine on a GGUF file holds no float32 copy of its dense weights or token embeddings (session 42): the linears
load released (models.quant_linear.released_weight) and multiply on their blocks, the embeddings are a QuantEmbedding.
Checked against the float copies the loader made before (load_model, MOETIER_FLOAT_COPIES=1), bit for bit where the
arithmetic is the same."""
from __future__ import annotations

import pytest
import torch
from helpers import max_rel_err

from moetier import EngineConfig
from moetier.commands.quantize import quantize
from moetier.errors import UserError
from moetier.kernels import cpu
from moetier.models.quant_linear import QuantEmbedding
from moetier.runtime import cpu_compile
from moetier.runtime.engine import Engine
from moetier.weights.loader import load_model
from test_gguf import build_qwen3_moe

needs_c = pytest.mark.skipif(cpu.backend() != "c", reason="the C kernels did not build here")
pytestmark = [needs_c, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("release")
    src = build_qwen3_moe(d / "model", hidden_size=256, moe_intermediate_size=256, intermediate_size=512,
                          num_hidden_layers=3, mlp_only_layers=[1], tie_word_embeddings=False)
    # Q8_0: every dense weight Q8_0 (its copies interleaved by 8 rows); Q4_K_M: attn_v / ffn_down / output Q6_K
    return {t: quantize(src, t, d / f"m-{t}.gguf") for t in ("Q8_0", "Q4_K_M")}


def _engine(path):
    return Engine.load(path, EngineConfig(device="cpu", threads=1, progress=False, max_context=128, cpu_compile="off"))


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
def test_no_float_copies_and_restored_bit_for_bit(files, ftype):
    """Every Linear weight is released (one NaN element, shape kept, its blocks as a copy), the embeddings are blocks;
    cpu_compile._drop_quantized_copies dequantizes the linears back: the loader's float32 values exactly (q/k/v as
    views of the stacked weight again), and the embedding rows are the float table's."""
    eng = _engine(files[ftype])
    floats, _, _ = load_model(files[ftype])
    lins = _linears(eng.model)
    assert lins and all(getattr(m.weight, "released", False) and m.weight.untyped_storage().nbytes() == 4
                        for m in lins.values())
    assert all(torch.isnan(m.weight).all() for m in lins.values())     # a missed reader computes NaN
    emb = eng.model.model.embed_tokens
    assert isinstance(emb, QuantEmbedding)
    tokens = torch.randint(0, emb.num_embeddings, (3, 7), generator=torch.Generator().manual_seed(1))
    want = floats.model.embed_tokens(tokens)
    assert torch.equal(emb(tokens), want) and emb(tokens).shape == (3, 7, emb.embedding_dim)
    cpu_compile._drop_quantized_copies(eng.model)
    ref = _linears(floats)
    for name, m in _linears(eng.model).items():
        assert not getattr(m.weight, "released", False) and torch.equal(m.weight, ref[name].weight), name
    attn = eng.model.model.layers[0].self_attn
    if attn.qkv_rows is not None:
        assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    cpu_compile.dense_copies(eng.model)                 # again: the same copies, released again
    assert all(getattr(m.weight, "released", False) for m in _linears(eng.model).values())


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
def test_released_prompt_matches_the_float_copies(files, ftype, monkeypatch):
    """A prompt through released linears that do not take the int8 tile (Q8_0's; here every linear: the tile's int8
    activations are checked in test_cpu_grouped) multiplies the copy's rows dequantized a chunk at a time (tiny chunks
    here: many, of rows interleaved by 8 in Q8_0's copies): the float copies' logits to float rounding."""
    monkeypatch.setattr(cpu_compile, "DEQUANT_CHUNK_BYTES", 4096)
    monkeypatch.setattr(cpu_compile, "_prefill_qgemm", lambda m, qtype: False)
    used = []
    inner = cpu_compile._dequant_gemm
    monkeypatch.setattr(cpu_compile, "_dequant_gemm", lambda *a: used.append(a[2]) or inner(*a))
    ours = _engine(files[ftype])
    monkeypatch.setattr(cpu_compile, "KEEP_FLOATS", True)
    ref = _engine(files[ftype])                         # float copies, no blocks: the loader's float32 GEMMs
    prompt = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        a = ours.model(prompt, ours.model.make_cache(64, torch.float32, "cpu"))
        b = ref.model(prompt, ref.model.make_cache(64, torch.float32, "cpu"))
    assert len(used) >= 3 * 2 + 3 + 1                   # q/k/v and o a layer (or stacked), the dense MLP, lm_head
    if ftype == "Q8_0":
        assert all(t == cpu.INTERLEAVED[8] for t in used)               # rows in lanes, undone per chunk
    assert max_rel_err(a, b) < 1e-5


def test_out_of_vocabulary_token_is_an_error(files):
    """A token id past the table through QuantEmbedding raises (no read past the blocks); the engine refuses it first
    with a UserError."""
    eng = _engine(files["Q8_0"])
    emb = eng.model.model.embed_tokens
    for bad in (emb.num_embeddings, -1):
        with pytest.raises((IndexError, RuntimeError), match="outside the vocabulary"):
            emb(torch.tensor([3, bad]))
    with pytest.raises(UserError, match="outside the vocabulary"):
        eng.encode(prompt_ids=[1, emb.num_embeddings])


def test_float_copies_kept_on_request(files, monkeypatch):
    """MOETIER_FLOAT_COPIES=1 (cpu_compile.KEEP_FLOATS): the loader's float32 weights and embedding table, as before."""
    monkeypatch.setattr(cpu_compile, "KEEP_FLOATS", True)
    eng = _engine(files["Q8_0"])
    assert isinstance(eng.model.model.embed_tokens, torch.nn.Embedding)
    assert not any(getattr(m.weight, "released", False) for m in _linears(eng.model).values())


@pytest.mark.slow
def test_compiled_step_on_released_weights(files, tmp_path, monkeypatch):
    """The AOT-compiled decode step of a GGUF file whose linears are released and whose embeddings are blocks (the trace
    swaps each weight for its copy; moetier::embed_rows keeps the table a uint8 buffer): the eager step's tokens and,
    step by step, its logits (test_cpu_compile._compare). Built into tmp_path (~10-20 s)."""
    from test_cpu_compile import _compare
    monkeypatch.setattr(cpu_compile, "CACHE_DIR", tmp_path)
    eng = _compare(files["Q4_K_M"], list(range(5, 45)), 16)
    assert isinstance(eng.model.model.embed_tokens, QuantEmbedding)
    names = eng._cpu_decode.runner.get_constant_fqns()          # (the step's module holds the model as `model`)
    assert "model.model.embed_tokens.blocks" in names
    assert not [n for n in names if n.endswith(("proj.weight", "lm_head.weight", "qkv_weight"))]   # floats unread


def test_memory_plan_counts_the_blocks(files, monkeypatch):
    """The CPU memory plan (moetier plan, --ram-mem tiers) counts a GGUF file's dense weights and embeddings as the run
    holds them: their blocks, and the rows-in-lanes copy beside the file's rows where the format has one (Q8_0's)."""
    from moetier.memory.plan import make_placement
    eng = _engine(files["Q8_0"])
    held = eng.model.model.embed_tokens.nbytes
    for m in eng.model.modules():
        for a in m.__dict__.get("_quant_copies", {}):
            held += m._buffers[f"{a}_q"].nbytes + sum(r.nbytes for r, _ in m.__dict__.get("_file_rows", {}).values())
    plan = make_placement(files["Q8_0"], EngineConfig(max_context=128, ram_mem=1 << 34), "cpu", torch.float32, 128)
    floats = sum(p.numel() * 4 for p in eng.model.parameters() if not getattr(p, "released", False))  # norms, routers
    assert plan.dense_bytes + plan.embed_bytes == held + floats
    monkeypatch.setattr(cpu_compile, "KEEP_FLOATS", True)
    floats = make_placement(files["Q8_0"], EngineConfig(max_context=128, ram_mem=1 << 34), "cpu", torch.float32, 128)
    assert plan.dense_bytes + plan.embed_bytes < 0.6 * (floats.dense_bytes + floats.embed_bytes)
