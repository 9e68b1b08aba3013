"""CUDA: the same code on one GPU gives the reference tokens (fp32) and close logits (bf16)."""
import pytest
import torch

from helpers import max_rel_err, ours_logits
from moetier.runtime.generate import greedy_tokens
from moetier.weights.loader import load_model

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_fp32_matches_cpu_and_greedy(tiny_model_dir):
    cpu, _, _ = load_model(tiny_model_dir)
    gpu, _, _ = load_model(tiny_model_dir, device="cuda")
    toks = torch.randint(0, 300, (21,), generator=torch.Generator().manual_seed(0))
    want = ours_logits(cpu, toks, 13)
    cache = gpu.make_cache(32, torch.float32, "cuda")
    with torch.no_grad():
        got = torch.cat([gpu(toks[:13].cuda(), cache)] + [gpu(toks[i:i + 1].cuda(), cache) for i in range(13, 21)])
    assert max_rel_err(got.cpu(), want) <= 1e-4
    assert greedy_tokens(gpu, toks[:5].tolist(), 32) == greedy_tokens(cpu, toks[:5].tolist(), 32)


@cuda
def test_cuda_bf16_close_to_fp32(tiny_model_dir):
    ref, _, _ = load_model(tiny_model_dir)
    gpu, _, _ = load_model(tiny_model_dir, device="cuda", dtype=torch.bfloat16)
    toks = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1))
    want = ours_logits(ref, toks, 40).double()
    cache = gpu.make_cache(48, torch.bfloat16, "cuda")
    with torch.no_grad():
        got = gpu(toks.cuda(), cache).double().cpu()
    kl = (torch.softmax(want, -1) * (torch.log_softmax(want, -1) - torch.log_softmax(got, -1))).sum(-1)
    assert kl.median() < 1e-3
    # bf16 (~3 significant digits; logits here differ by up to ~0.4) may flip near-ties of a random
    # tiny model: the reference's winner must stay within 1.0 of bf16's best everywhere
    gap = got.max(-1).values - got.gather(1, want.argmax(-1, keepdim=True))[:, 0]
    assert gap.max() < 1.0
    assert (got.argmax(-1) == want.argmax(-1)).double().mean() >= 0.75


@cuda
@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss", "glm4_moe", "mixtral", "olmoe"])
def test_other_architectures_on_cuda_fp32(tmp_path, arch):
    """Each architecture's tiny model: CUDA fp32 == CPU fp32 greedy tokens."""
    import importlib
    mod = importlib.import_module(f"test_arch_{arch}")
    build = getattr(mod, "build_for_gpu_test", None)
    if build is None:
        pytest.skip(f"test_arch_{arch} has no build_for_gpu_test")
    path = build(tmp_path)
    cpu, _, _ = load_model(path)
    gpu, _, _ = load_model(path, device="cuda")
    prompt = list(range(3, 10))
    assert greedy_tokens(gpu, prompt, 24) == greedy_tokens(cpu, prompt, 24)


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_gives_the_eager_tokens(tiny_model_dir, dtype):
    from moetier import EngineConfig, SamplingParams
    from moetier.runtime.engine import Engine
    tokens = {}
    for graphs in (False, True):
        eng = Engine.load(tiny_model_dir, EngineConfig(device="cuda", dtype=dtype, cuda_graphs=graphs,
                                                       max_context=128, progress=False))
        done = eng.complete(prompt_ids=list(range(5, 17)), max_tokens=40, params=SamplingParams(temperature=0),
                            ignore_eos=True)
        tokens[graphs] = done.token_ids
        # a second turn on the same session replays the same captured graph after prefix reuse
        s = eng.new_session()
        eng.complete(prompt_ids=list(range(5, 17)), max_tokens=5, params=SamplingParams(temperature=0),
                     session=s, ignore_eos=True)
        again = eng.complete(prompt_ids=list(range(5, 17)), max_tokens=40, params=SamplingParams(temperature=0),
                             session=s, ignore_eos=True)
        assert again.token_ids == done.token_ids
    assert tokens[True] == tokens[False]
