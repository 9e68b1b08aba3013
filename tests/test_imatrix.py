"""`moetier imatrix`: llama-imatrix's importance matrix from moetier's own forward, read back by libgguf (what
`moetier quantize --imatrix` and llama-quantize read), checked against hooks on the modules themselves."""
import numpy as np
import pytest
import torch

from moetier.commands.imatrix import compute
from moetier.commands.quantize import quantize
from moetier.weights.loader import load_model
from test_gguf import TEXT, build_qwen3_moe

CHUNK = 32


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return build_qwen3_moe(tmp_path_factory.mktemp("imatrix") / "wide", hidden_size=256, moe_intermediate_size=256,
                           intermediate_size=256, head_dim=64)


def test_imatrix_matches_the_modules_inputs(wide, tmp_path):
    libgguf = pytest.importorskip("libgguf")
    text = " ".join(TEXT * 8)
    out = compute(wide, text, tmp_path / "im.gguf", chunk=CHUNK, max_chunks=3)
    got = libgguf.load_imatrix(out)                     # averaged: in_sum2 / counts per matrix
    model, args, _ = load_model(wide)
    from moetier.weights.tokenizer import Tokenizer
    ids = Tokenizer.from_dir(wide).encode(text, add_special=False)
    seen = {"q": [], "gate": []}
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    attn.q_proj.register_forward_pre_hook(lambda m, a: seen["q"].append(a[0].reshape(-1, a[0].shape[-1])))
    mlp.gate.register_forward_pre_hook(lambda m, a: seen["gate"].append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.inference_mode():
        for c in range(3):
            model(torch.tensor(ids[c * CHUNK:(c + 1) * CHUNK]), model.make_cache(CHUNK, torch.float32, "cpu"))
    x = torch.cat(seen["q"]).double()
    want = (x * x).mean(0).float().numpy()
    assert got["blk.0.attn_q.weight"].shape == (256,)
    np.testing.assert_allclose(got["blk.0.attn_q.weight"], want, rtol=1e-5)
    np.testing.assert_allclose(got["blk.0.attn_k.weight"], want, rtol=1e-5)       # the same input
    # experts: one row per expert, the mean over the tokens routed to it; gate and up share the input
    e, k = args.num_experts, args.num_experts_per_tok
    gate = got["blk.0.ffn_gate_exps.weight"].reshape(e, 256)
    np.testing.assert_array_equal(gate, got["blk.0.ffn_up_exps.weight"].reshape(e, 256))
    xs = torch.cat(seen["gate"]).double()
    logits = xs @ mlp.gate.weight.double().T                   # softmax then top-k: the same choice
    chosen = logits.topk(k, dim=-1).indices
    for ex in range(e):
        rows = (chosen == ex).any(-1)
        if rows.any():
            np.testing.assert_allclose(gate[ex], (xs[rows] ** 2).mean(0).float().numpy(), rtol=1e-4)
    assert got["blk.0.ffn_down_exps.weight"].shape == (e * 256,) and (got["blk.0.ffn_down_exps.weight"] > 0).all()


def test_quantize_with_a_computed_imatrix_runs_in_llama_cpp(wide, tmp_path):
    """The whole route a user takes to a 2-bit file: imatrix, then IQ2_XXS (impossible without one); llama.cpp
    loads it and generates."""
    pytest.importorskip("libgguf")
    from test_gguf_llamacpp import PROMPT, llama_cpp_greedy
    im = compute(wide, " ".join(TEXT * 8), tmp_path / "im.gguf", chunk=CHUNK)
    out = quantize(wide, "IQ2_XXS", tmp_path / "m-IQ2_XXS.gguf", imatrix=im)
    assert len(llama_cpp_greedy(out, PROMPT, 4)) == 4
    assert load_model(out)[0] is not None
