"""generate_stream's pipelined greedy decoding (runtime.cuda_graph.GraphStep's contract: the next step is queued
before the host reads this one's token; a step queued past a stop is discarded) against the plain loop, on the CPU:
`EagerPipe` keeps GraphStep's contract with eager steps. The CUDA graph itself: tests/test_gpu.py."""
from collections import deque

import pytest
import torch

from moetier import SamplingParams
from moetier.runtime.generate import Done, TokenEvent, generate_stream
from moetier.runtime.sampling import Sampler
from moetier.tools.bench_core import Forcing


class EagerPipe:
    """GraphStep's pipelined contract with eager steps: launch computes at once, at the cache's length plus the steps
    queued, without moving the cache's length; collect advances it; discard drops what is queued."""
    pipelined = True

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.queue: deque = deque()
        self.prev = None
        self.launched = self.discarded = 0

    def launch(self, tok):
        tok = self.prev if tok is None else tok
        c = self.cache
        at = c.length + len(self.queue)
        assert at + 1 <= c.max_len and len(self.queue) < 2
        saved, c.length = c.length, at
        with torch.inference_mode():
            logits = self.model(torch.tensor([tok]), c, last_only=True)[-1]
        c.length = saved
        self.prev = int(torch.argmax(logits))
        self.queue.append(self.prev)
        self.launched += 1

    def collect(self):
        self.cache.advance(1)
        return self.queue.popleft()

    def discard(self):
        self.discarded += len(self.queue)
        self.queue.clear()

    def __call__(self, tok):
        raise AssertionError("the pipelined path never asks for logits")


def stream(engine, ids, max_tokens, pipe=False, eos=(), stops=(), ctx=256, params=SamplingParams(temperature=0),
           processor=None, logprobs=None, take=None):
    model = engine.model
    cache = model.make_cache(ctx, torch.float32, "cpu")
    sampler = Sampler(params, engine.args.vocab_size, "cpu", ids)
    step = EagerPipe(model, cache) if pipe else None
    gen = generate_stream(model, cache, ids, ids, sampler, max_tokens, set(eos), None, list(stops), logprobs,
                          logits_processor=processor, step=step)
    events = []
    for ev in gen:
        events.append(ev)
        if take is not None and len(events) == take:
            gen.close()
            break
    return events, cache, step


def tokens(events):
    return [e.token_id for e in events if isinstance(e, TokenEvent) and e.token_id >= 0]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from moetier import EngineConfig
    from moetier.runtime.engine import Engine
    return Engine.load(tiny_model_dir, EngineConfig(device="cpu", max_context=256, progress=False))


@pytest.fixture(scope="module")
def prompt(engine):
    return torch.randint(3, engine.args.vocab_size, (9,), generator=torch.Generator().manual_seed(5)).tolist()


def test_pipelined_greedy_gives_the_plain_loops_tokens_and_cache(engine, prompt):
    plain, c0, _ = stream(engine, prompt, 12)
    piped, c1, pipe = stream(engine, prompt, 12, pipe=True)
    assert tokens(piped) == tokens(plain) and len(tokens(plain)) == 12
    # 11 steps feed tokens 1..11 (the first comes from the prefill); none was queued past the last
    assert pipe.launched == 11 and pipe.discarded == 0 and c1.length == c0.length == len(prompt) + 11
    assert piped[-1].finish_reason == plain[-1].finish_reason == "length"


def test_a_step_queued_past_eos_is_discarded(engine, prompt):
    free = tokens(stream(engine, prompt, 10)[0])
    cut = next(i for i in range(2, 10) if free[i] not in free[:i])
    plain, c0, _ = stream(engine, prompt, 10, eos=[free[cut]])
    piped, c1, pipe = stream(engine, prompt, 10, pipe=True, eos=[free[cut]])
    assert tokens(piped) == tokens(plain) == free[:cut]
    assert piped[-1].finish_reason == "stop" and pipe.discarded == 1 and c1.length == c0.length


def test_stop_string_context_end_and_early_close(engine, prompt):
    # the context's end: the pipelined loop never queues a step past it
    plain, c0, _ = stream(engine, prompt, 100, ctx=len(prompt) + 7)
    piped, c1, pipe = stream(engine, prompt, 100, pipe=True, ctx=len(prompt) + 7)
    assert tokens(piped) == tokens(plain) and c1.length == c0.length <= c1.max_len
    # the consumer stops reading: the queued steps are discarded by the generator's close
    piped, _, pipe = stream(engine, prompt, 20, pipe=True, take=3)
    assert len(piped) == 3 and pipe.discarded >= 1 and not pipe.queue


def test_forced_inputs_go_ahead_and_other_sampling_stays_plain(engine, prompt):
    forced = torch.randint(3, engine.args.vocab_size, (8,), generator=torch.Generator().manual_seed(9)).tolist()
    plain, c0, _ = stream(engine, prompt, 8, processor=Forcing(forced))
    piped, c1, pipe = stream(engine, prompt, 8, pipe=True, processor=Forcing(forced))
    assert tokens(piped) == tokens(plain) == forced and pipe.launched == 7 and c1.length == c0.length
    # a processor without forced ids, logprobs or sampling: the plain loop (the pipe would fail if asked for logits)
    for kw in ({"processor": lambda out, logits: logits}, {"logprobs": 2},
               {"params": SamplingParams(temperature=0.8, seed=1)}):
        with pytest.raises(AssertionError, match="never asks for logits"):
            stream(engine, prompt, 4, pipe=True, **kw)
    assert isinstance(plain[-1], Done)


def test_pipeline_switch_names_its_values(monkeypatch):
    """MOETIER_PIPELINE takes 1 or 0: anything else is an error that says so (before any CUDA allocation)."""
    from types import SimpleNamespace

    from moetier.errors import UserError
    from moetier.runtime.cuda_graph import GraphStep
    monkeypatch.setenv("MOETIER_PIPELINE", "yes")
    with pytest.raises(UserError, match="MOETIER_PIPELINE='yes': use 1"):
        GraphStep(SimpleNamespace(next=torch.zeros(1), tiers=None, tokens=torch.zeros(1)))
