"""Token embeddings in pinned RAM (models.host_embedding, kernels.triton_embed, the loader's host_embed, the plan).

The gather kernel runs under the Triton interpreter on the CPU; the GPU test compares an engine with the table in
pinned RAM against --gpu-embed (the same rows, so the same tokens).
"""
from __future__ import annotations

import pytest
import torch

from moetier.models.host_embedding import HostEmbedding


def test_gather_rows_kernel_matches_embedding():
    """Rows of a [V, D] table for random tokens (first and last ids included), D not a multiple of the block:
    an exact copy, in the table's dtype, shaped like the tokens."""
    import os
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        pytest.skip("runs in the Triton interpreter (CPU-only machine)")
    from moetier.kernels import ops
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 1500, generator=g).to(torch.bfloat16)
    tokens = torch.cat([torch.tensor([0, 49]), torch.randint(0, 50, (7,), generator=g)]).view(3, 3)
    prev = ops.backend()
    try:
        assert ops.set_backend("triton") == "triton"
        got = ops.embed_rows(table, tokens)
    finally:
        ops.set_backend(prev)
    assert got.shape == (3, 3, 1500) and got.dtype == torch.bfloat16
    assert torch.equal(got, ops.embed_rows_native(table, tokens))
    assert torch.equal(got, torch.nn.functional.embedding(tokens, table))


def test_host_embedding_module():
    table = torch.randn(20, 8, generator=torch.Generator().manual_seed(1))
    emb = HostEmbedding(table)
    tok = torch.tensor([3, 19, 0])
    assert torch.equal(emb(tok), table[tok]) and emb.nbytes == 20 * 8 * 4
    assert "host" in repr(emb) and emb.num_embeddings == 20 and emb.embedding_dim == 8
    with pytest.raises(ValueError, match="host memory"):
        HostEmbedding(torch.randn(4, 4, device="meta"))


def test_loader_host_embed_gives_the_same_logits(tmp_path):
    """load_model(host_embed=True): the embedding becomes a HostEmbedding (not a parameter) holding the table the
    plain load has; the model's logits are the same."""
    from moetier.tools.synth import synth
    from moetier.weights.loader import load_model
    path = tmp_path / "q.gguf"
    synth("qwen3-30b-a3b", "Q8_0", path, layers=1, scale="tiny", log=lambda *a: None, progress=False)
    plain, args, _ = load_model(path)
    host, _, _ = load_model(path, host_embed=True)
    assert isinstance(host.model.embed_tokens, HostEmbedding)
    assert "model.embed_tokens.weight" not in dict(host.named_parameters())
    assert torch.equal(host.model.embed_tokens.weight, plain.model.embed_tokens.weight)
    tokens = torch.randint(0, args.vocab_size, (6,), generator=torch.Generator().manual_seed(2))
    from moetier.runtime.kv_cache import session_cache
    with torch.inference_mode():
        a = plain(tokens, session_cache(plain, 16, torch.float32, "cpu"))
        b = host(tokens, session_cache(host, 16, torch.float32, "cpu"))
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_host_embedding_on_cuda(tmp_path):
    """With a GPU budget the table sits in pinned RAM (less VRAM than --gpu-embed) and the graphed decode gives
    --gpu-embed's tokens (the gathered rows are the same bits)."""
    from moetier import EngineConfig, SamplingParams
    from moetier.runtime.engine import Engine
    from moetier.tools.synth import synth
    path = tmp_path / "q.gguf"
    synth("qwen3-30b-a3b", "Q4_0", path, layers=2, scale="tiny", log=lambda *a: None, progress=False)
    runs = {}
    for gpu_embed in (False, True):
        eng = Engine.load(path, EngineConfig(device="cuda", dtype="bfloat16", gpu_mem=1 << 30, gpu_embed=gpu_embed,
                                             max_context=128, progress=False))
        emb = eng.model.model.embed_tokens
        assert isinstance(emb, HostEmbedding) != gpu_embed
        if not gpu_embed:
            assert emb.weight.is_pinned() and emb.weight.device.type == "cpu"
        runs[gpu_embed] = eng.complete(prompt_ids=list(range(5, 30)), max_tokens=16,
                                       params=SamplingParams(temperature=0), ignore_eos=True).token_ids
        eng.tiers.close()
        del eng
        torch.cuda.empty_cache()
    assert runs[False] == runs[True]
