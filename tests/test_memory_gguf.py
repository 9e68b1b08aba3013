"""GGUF checkpoints in the memory tiers, experts kept quantized in every tier.

A tiny random qwen3_moe (D = I = 256, so Q4_K fits) written as Q8_0 / Q4_0 / Q4_K_S GGUFs by
`moetier quantize`, then loaded with tier flags and compared with the same GGUF loaded without
tiers (experts dequantized to float32 up front). Fast-tier hits run through kernels.ops.moe (the
torch twin on CPU: dequantize + matmul, measured bit-identical to the dense model); CPU misses
through the C kernels of kernels/cpu.py, which round differently. Measured max |logit diff| /
max |logit|: 0 with every expert in the fast tier, 0.5-1.4e-6 with CPU misses (all qtypes and
placements); asserted below TOL = 1e-5.
"""
import json
from pathlib import Path

import pytest
import torch
from helpers import bandwidths_home, ours_logits
from test_gguf import build_qwen3_moe

from moetier.cli import main
from moetier.commands.quantize import quantize
from moetier.config import EngineConfig
from moetier.errors import UserError
from moetier.kernels import cpu, ops
from moetier.memory.plan import inspect, make_placement
from moetier.models.layers import swiglu
from moetier.quant.pack import quantize as pack
from moetier.runtime.engine import Engine
from moetier.runtime.generate import greedy_tokens
from moetier.weights.gguf import GGUFFile
from moetier.weights.loader import load_model

CTX, PROMPT, SPLIT, N_GREEDY = 64, 24, 12, 12
TOL = 1e-5                  # max |logit diff| / max |logit|; measured <= 1.4e-6 (C kernels vs torch)
KINDS = {"Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_K_S": "Q4_K", "MXFP4_MOE": "MXFP4",
         "IQ3_XXS": "IQ3_XXS"}   # file type -> the experts' GGML type (IQ3_XXS --pure: ffn_down IQ3_XXS too)
MODEL = {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "mlp_only_layers": [1], "num_experts": 8, "num_experts_per_tok": 2}     # MoE layers 0, 2, 3


pytestmark = pytest.mark.usefixtures("one_torch_thread", "float_dense")


@pytest.fixture
def float_dense(monkeypatch):
    """The engines keep their dense weights' float32 copies (MOETIER_FLOAT_COPIES=1), as the reference load_model
    does: the logits compared then differ only where the experts are placed."""
    from moetier.runtime import cpu_compile
    monkeypatch.setattr(cpu_compile, "KEEP_FLOATS", True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_qwen3_moe(tmp_path_factory.mktemp("gguf_tiers") / "model", **MODEL)


@pytest.fixture(scope="module", params=list(KINDS))
def gguf(request, model_dir):
    out = quantize(model_dir, request.param, model_dir.parent / f"m-{request.param}.gguf",
                   pure=request.param == "IQ3_XXS")
    dense, _, _ = load_model(out)
    tokens = torch.randint(0, 300, (PROMPT,), generator=torch.Generator().manual_seed(3))
    return out, tokens, logits(dense, tokens), greedy_tokens(dense, tokens[:SPLIT].tolist(), N_GREEDY)


def logits(model, tokens):
    return ours_logits(model, tokens, SPLIT, CTX)


def sizes(path):
    """(fixed RAM bytes of a CPU load, bytes per expert in RAM, bytes per expert in the fast tier)."""
    pl = make_placement(path, EngineConfig(max_context=CTX, ram_mem=1 << 34), "cpu", torch.float32, CTX)
    fixed = pl.dense_bytes + pl.embed_bytes + pl.kv_bytes + pl.workspace_bytes + pl.scratch * pl.expert_bytes
    return fixed, pl.expert_bytes, pl.expert_fast_bytes


@pytest.fixture
def no_mmap_experts(monkeypatch):
    """Call it to make sure expert bytes come from os.preadv at file offsets, never the GGUF mmap."""
    raw = GGUFFile.raw

    def guarded(self, name):
        if "_exps" in name:
            raise AssertionError(f"expert tensor {name} read through the mmap")
        return raw(self, name)
    return lambda: monkeypatch.setattr(GGUFFile, "raw", guarded)


def check(gguf, path=None, qtypes=None, **kw) -> Engine:
    out, tokens, want, want_toks = gguf
    eng = Engine.load(path or out, EngineConfig(progress=False, max_context=CTX, **kw))
    if qtypes is None:
        assert eng.tiers.layout.qtype in KINDS.values()
    else:                                                   # the formats the fast tier's kernels read, any layer
        fmts = {eng.tiers.fast.kernel_weights(li)[0] for li in range(len(eng.tiers.layout.layers))}
        assert {f for fmt in fmts for f in ((fmt,) if isinstance(fmt, str) else fmt)} == set(qtypes)
    got = logits(eng.model, tokens)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= TOL, f"logits differ under {kw}: max rel {err:.2e}"
    assert greedy_tokens(eng.model, tokens[:SPLIT].tolist(), N_GREEDY) == want_toks, f"greedy tokens differ under {kw}"
    eng.tiers.cache.check()
    return eng


def test_all_resident(gguf, no_mmap_experts):
    no_mmap_experts()
    st = check(gguf, gpu_mem=1 << 30, ram_mem=1 << 30).memory_stats()
    assert st["hit_rate"] == 1.0 and st["tiers"]["gpu"]["experts"] == 3 * 8


def test_ram_bank_only_and_few_fast_slots(gguf, no_mmap_experts):
    no_mmap_experts()
    st = check(gguf, ram_mem=1 << 30).memory_stats()
    assert st["tiers"]["ram"]["all_experts"] and st["hit_rate"] == 0.0
    _, _, fb = sizes(gguf[0])
    st = check(gguf, gpu_mem=7 * fb, ram_mem=1 << 30, prefill_copy_tokens=2).memory_stats()
    c = st["cumulative"]
    assert sum(x["slots"] for x in st["layers"]) == 5 and c["hits"]["gpu"] > 0 and c["hits"]["ram"] > 0
    assert c["admissions"] > 0          # decode misses copied (repacked) into the fast tier
    assert c["staged_prefill_experts"] > 0      # prefill misses run on the 2 stage slots


def test_streaming_from_a_split_file(gguf, model_dir, no_mmap_experts, tmp_path):
    split = quantize(model_dir, _file_type(gguf[0]), tmp_path / "s.gguf", split_max_tensors=8,
                     pure=_file_type(gguf[0]) == "IQ3_XXS")
    assert "-00001-of-" in split.name
    no_mmap_experts()
    fixed, eb, _ = sizes(split)
    st = check(gguf, split, ram_mem=fixed + 2 * eb).memory_stats()
    c = st["cumulative"]
    assert st["tiers"]["ram"]["slots"] == 2
    assert c["hits"]["ssd"] > 0.8 * (c["hits"]["ram"] + c["hits"]["ssd"]), c["hits"]
    assert c["bytes_read"]["ssd"] > 0
    layout = inspect(split)[3]
    assert len({p.path for li in range(3) for p in layout.parts(li, 5)}) > 1    # experts in several files


def _file_type(path: Path) -> str:
    return next(k for k in KINDS if path.name == f"m-{k}.gguf")


def test_n_cpu_moe_and_overrides(gguf):
    fixed, eb, fb = sizes(gguf[0])
    eng = check(gguf, gpu_mem=1 << 30, ram_mem=1 << 30, n_cpu_moe=3)
    assert eng.tiers.pl.layer_tiers == ["cpu", "cpu", "auto"] and eng.tiers.pl.fast_slots[:2] == [0, 0]
    rules = ((r"blk\.3\.ffn_.*_exps", "gpu"), (r"blk\.2\.", "disk"), (r"experts", "cpu"))
    eng = check(gguf, gpu_mem=20 * fb, ram_mem=fixed + 20 * eb, override_tensor=rules)
    assert eng.tiers.pl.layer_tiers == ["cpu", "disk", "gpu"] and eng.tiers.pl.fast_slots == [0, 0, 8]
    st = eng.memory_stats()
    assert st["layers"][1]["ram"] == 0 and st["layers"][2]["hit_rate"] == 1.0


def test_kernel_weights_are_the_arena(gguf):
    """FastTier.kernel_weights() -> what ops.moe_decode takes, for every slot, without copies."""
    eng = Engine.load(gguf[0], EngineConfig(progress=False, max_context=CTX, gpu_mem=1 << 30, ram_mem=1 << 30))
    fast, tiers = eng.tiers.fast, eng.tiers
    fmt, gate_up, down = fast.kernel_weights()
    assert fmt == tiers.layout.qtype and gate_up is fast.arena["gate_up_proj"] and down is fast.arena["down_proj"]
    assert gate_up["qs"].shape[0] == fast.n_slots + len(fast.stage)
    li, x = 1, torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 5], [7, 2], [5, 3]])
    w = torch.rand(3, 2, generator=torch.Generator().manual_seed(1))
    slots = tiers.cache.table[li][ids]
    got = ops.moe_decode(x, slots, w, gate_up, down, swiglu, fmt=fmt)
    dense, _, _ = load_model(gguf[0])
    want = dense.model.layers[2].mlp.experts(x, ids, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("ftype", ["F32", "F16", "BF16"])
def test_float_gguf_is_bit_identical(model_dir, tmp_path, ftype):
    """Float experts take the float path: bit-identical to the GGUF loaded without tiers."""
    out = quantize(model_dir, ftype, tmp_path / f"m-{ftype}.gguf")
    dense, _, _ = load_model(out)
    tokens = torch.randint(0, 300, (PROMPT,), generator=torch.Generator().manual_seed(5))
    fixed, eb, fb = sizes(out)
    eng = Engine.load(out, EngineConfig(progress=False, max_context=CTX, gpu_mem=4 * fb, ram_mem=fixed + 4 * fb + 3 * eb))
    want_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[ftype]
    assert eng.tiers.layout.qtype is None and eng.tiers.pl.storage_dtype == want_dtype
    assert torch.equal(logits(eng.model, tokens), logits(dense, tokens))
    fmt, gate_up, _ = eng.tiers.fast.kernel_weights()
    assert fmt == "dense" and gate_up is eng.tiers.fast.arena["gate_up_proj"] and gate_up.dim() == 3


def test_unsupported_expert_type_is_a_user_error(model_dir, tmp_path):
    out = quantize(model_dir, "Q5_1", tmp_path / "m-q5_1.gguf")   # no GPU kernel (Q4_K_M: tests/test_gguf_mixed.py)
    with pytest.raises(UserError, match="Q5_1"):
        Engine.load(out, EngineConfig(progress=False, max_context=CTX, ram_mem=1 << 30))


@pytest.mark.parametrize("ftype,qtypes", [("Q2_K", {"Q2_K", "Q3_K"}), ("IQ3_M", {"IQ3_S", "Q4_K"})])
def test_low_bit_files_in_the_tiers(model_dir, tmp_path, ftype, qtypes):
    """llama.cpp's 2-3-bit mixes (Q2_K: gate / up Q2_K, down Q3_K; IQ3_M: IQ3_S, some downs Q4_K) stay packed in
    every tier (the GPU kernels read Q2_K / Q3_K as quant.repack planes, IQ3_S's GGML rows as stored,
    kernels/triton_rawq.py): all experts in the fast tier (the torch twin here) exactly the file dequantized at load,
    all in RAM (the C kernels) within TOL."""
    out = quantize(model_dir, ftype, tmp_path / f"m-{ftype}.gguf")
    dense, _, _ = load_model(out)
    tokens = torch.randint(0, 300, (PROMPT,), generator=torch.Generator().manual_seed(3))
    gguf = out, tokens, logits(dense, tokens), greedy_tokens(dense, tokens[:SPLIT].tolist(), N_GREEDY)
    for kw in ({"gpu_mem": 1 << 30, "ram_mem": 1 << 30}, {"ram_mem": 1 << 30}):
        eng = check(gguf, qtypes=qtypes, **kw)
        assert eng.memory_stats()["hit_rate"] == (1.0 if "gpu_mem" in kw else 0.0)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K"])
@pytest.mark.parametrize("n", [1, 3])
def test_expert_ffn_matches_its_torch_twin(qtype, n):
    g = torch.Generator().manual_seed(n)
    d, i = 256, 512
    gate_up, down = pack(torch.randn(2 * i, d, generator=g), qtype), pack(torch.randn(d, i, generator=g), qtype)
    x = torch.randn(n, d, generator=g)
    got = cpu.expert_ffn(qtype, gate_up, down, x, swiglu)
    want = cpu.expert_ffn_native(qtype, gate_up, down, x, swiglu)
    assert got.shape == (n, d) and got.dtype == torch.float32 and want.abs().min() > 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_plan_reads_only_gguf_headers(gguf, monkeypatch, tmp_path, capsys):
    def boom(*a, **k):
        raise AssertionError("plan read weight data")
    monkeypatch.setattr(GGUFFile, "raw", boom)
    monkeypatch.setattr(GGUFFile, "tensor", boom)
    bandwidths_home(monkeypatch, tmp_path,
        {"ram_gbs": 20.0, "hbm_gbs": 4000.0, "pcie_gbs": 24.0, "ssd_gbs": 2.0, "cpu_gbs_bfloat16": 10.0,
         "cpu_gflops_bfloat16": 100.0, "cpu_gbs_float32": 10.0, "cpu_gflops_float32": 100.0})
    kind = KINDS[_file_type(gguf[0])]
    from moetier.quant.formats import get_format
    raw = get_format(kind).nbytes((3 * 256, 256))          # gate + up + down rows of one expert
    # the fast tier's planes (quant.repack): Q4_K's sc, mn unpacked (+4 B per row of 256); IQ3_XXS's scales a byte and
    # signs 4 bytes per 32 (106 B per 256 against 98)
    fast = raw + 3 * 256 * {"Q4_K": 4, "IQ3_XXS": 8}.get(kind, 0)
    rc = main(["plan", str(gguf[0]), "--gpu-mem", f"{10 * fast}", "--ram-mem", "1GiB", "--ctx", str(CTX), "--json"])
    p = json.loads(capsys.readouterr().out)
    assert rc == 0 and not p["problems"] and p["storage_dtype"] == kind
    ex = p["experts"]
    assert ex["bytes_per_expert"] == -(-raw // 4096) * 4096 and ex["fast_bytes_per_expert"] == fast
    assert p["tiers"]["gpu"]["slots"] == 10
    rc = main(["plan", str(gguf[0]), "--ram-mem", "1GiB", "--ctx", str(CTX)])
    assert rc == 0 and kind in capsys.readouterr().out


def test_gpt_oss_gguf_experts_with_biases_in_the_tiers(tmp_path):
    """gpt-oss (expert biases, clamped SwiGLU) from an F32 GGUF: a few fast slots or every expert in RAM
    give the untiered model's greedy tokens, with misses computed from the RAM bank."""
    from test_gguf import other_arch

    from moetier import SamplingParams
    path = quantize(other_arch("gpt_oss", tmp_path / "model"), "F32", tmp_path / "m.gguf")
    fixed, _, fb = sizes(path)
    got = {}
    for name, kw in {"untiered": {}, "few_slots": dict(gpu_mem=5 * fb, ram_mem=1 << 32),
                     "cpu_moe": dict(cpu_moe=True, ram_mem=1 << 32)}.items():
        eng = Engine.load(path, EngineConfig(progress=False, device="cpu", dtype="float32", max_context=CTX, **kw))
        got[name] = eng.complete(prompt_ids=list(range(3, 27)), max_tokens=10, params=SamplingParams(temperature=0),
                                 ignore_eos=True).token_ids
        if eng.tiers is not None:
            assert {p.name for p in eng.tiers.layout.params} >= {"gate_up_bias", "down_bias"}
            assert eng.memory_stats()["hit_rate"] < 1.0, name
            eng.tiers.close()
    assert got["few_slots"] == got["untiered"] and got["cpu_moe"] == got["untiered"]


def test_interleaved_bank_is_undone_for_every_other_reader(gguf):
    """memory/doorbell.interleave_bank (done when a graphed decode starts, CUDA): the RAM bank's Q8_0 / Q4_0 / Q4_K
    expert rows interleaved by 8 in place, here on a CPU load with a few fast slots. Every other reader undoes it: the
    eager CPU misses (Tiers._cpu_weights) and the fast tier's copies of admitted experts (FastTier._ggml_rows), so the
    logits stay within TOL of the untiered model's and the greedy tokens do not move (prefill's staged copies and decode's admissions both copy from the bank);
    the miss server gets the interleaved type ids; a second call changes nothing."""
    from moetier.memory.doorbell import _qtype_id, interleave_bank
    if not cpu.interleaved_supported(2):
        pytest.skip("the C kernels are built without int8 activations")
    out, tokens, want, want_toks = gguf
    _, _, fb = sizes(out)
    eng = Engine.load(out, EngineConfig(progress=False, max_context=CTX, ram_mem=1 << 30, gpu_mem=7 * fb,
                                        prefill_copy_tokens=2))
    tiers, lay = eng.tiers, eng.tiers.layout
    bank = [b.clone() for b in tiers.bank.slots]
    x8 = interleave_bank(tiers, "0")
    if lay.qtype == "IQ3_XXS":                              # no interleaved layout: the bank stays as the file has it
        assert not x8 and all(torch.equal(a, b) for a, b in zip(bank, tiers.bank.slots))
        return
    assert {n for n, _ in x8} == {"gate_up_proj", "down_proj"} and tiers.fast.x8 is x8
    assert any(not torch.equal(a, b) for a, b in zip(bank, tiers.bank.slots))          # the rows moved
    li, e = 0, int(tiers.bank.where[0].argmax())
    buf = tiers.bank.slots[int(tiers.bank.where[li, e])]
    orig = lay.unpack(bank[int(tiers.bank.where[li, e])], li)
    assert all(torch.equal(v, orig[n]) for n, v in tiers._cpu_weights(buf, li).items())
    assert interleave_bank(tiers, "0") is x8                                            # once per bank
    ids = _qtype_id(lay, x8)
    assert all(t in cpu.INTERLEAVED.values() for pair in (ids if isinstance(ids, list) else [ids]) for t in pair)
    c0 = eng.memory_stats()["cumulative"]
    got = logits(eng.model, tokens)     # (hits on the torch twin, misses in C: a warmer cache rounds otherwise)
    assert ((got - want).abs().max() / want.abs().max()).item() <= TOL
    assert greedy_tokens(eng.model, tokens[:SPLIT].tolist(), N_GREEDY) == want_toks
    c1 = eng.memory_stats()["cumulative"]
    assert c1["admissions"] > c0["admissions"] and c1["staged_prefill_experts"] > c0["staged_prefill_experts"]
    tiers.cache.check()
