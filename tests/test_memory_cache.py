"""Property tests of the fast-tier slot cache (memory/cache.py) against simple reference models."""
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.memory.cache import SlotCache

E = 12

# one step: (layer, experts used in this call, admit the misses?)
steps = st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, E - 1), min_size=1, max_size=5, unique=True),
                           st.booleans()), min_size=1, max_size=60)
sizes_st = st.lists(st.integers(0, 6), min_size=3, max_size=3)


def run(cache: SlotCache, ops, after=None):
    total = 0
    for li, experts, admit in ops:
        routes = [1 + e % 3 for e in experts]
        slots = cache.lookup(li, experts, routes)
        total += sum(routes)
        assert all((s >= 0) == (cache.slot_of[li, e] >= 0) for e, s in zip(experts, slots))
        if admit:
            for e, s in zip(experts, slots):
                if s < 0:
                    cache.admit(li, e)
        if after:
            after(li, experts, slots, admit)
        cache.check()
    return total


@settings(max_examples=150, deadline=None)
@given(sizes=sizes_st, ops=steps, policy=st.sampled_from(["lru", "lfu", "static", "mix"]),
       pins=st.lists(st.tuples(st.integers(0, 2), st.integers(0, E - 1)), max_size=6))
def test_capacity_counts_and_pins(sizes, ops, policy, pins):
    cache = SlotCache(E, sizes, policy)
    pinned = set()
    for li, e in pins:
        if cache.place(li, e, pin=True) is not None:
            pinned.add((li, e))
    total = run(cache, ops)
    assert int(cache.hits.sum() + cache.misses.sum()) == total            # every route counted once
    for li, e in pinned:                                                  # pins never evicted
        assert cache.slot_of[li, e] >= 0
    for li, size in enumerate(cache.sizes):
        assert cache.resident(li) <= size
    if policy == "static":
        assert cache.admissions == 0
    assert cache.evictions <= cache.admissions


@settings(max_examples=150, deadline=None)
@given(size=st.integers(1, 5), ops=st.lists(st.lists(st.integers(0, E - 1), min_size=1, max_size=4, unique=True),
                                            min_size=1, max_size=60))
def test_lru_matches_reference(size, ops):
    cache = SlotCache(E, [size], "lru")
    ref: OrderedDict[int, None] = OrderedDict()      # resident experts, least recent first
    for experts in ops:
        slots = cache.lookup(0, experts)
        for e, s in zip(experts, slots):
            assert (s >= 0) == (e in ref)
            if e in ref:
                ref.move_to_end(e)
        for e, s in zip(experts, slots):
            if s < 0:
                got = cache.admit(0, e)
                if len(ref) >= size:
                    victim = next(iter(ref))
                    del ref[victim]
                    assert got[1] == victim, "LRU evicted the wrong expert"
                else:
                    assert got[1] == -1
                ref[e] = None
        assert set(np.flatnonzero(cache.slot_of[0] >= 0).tolist()) == set(ref)
        cache.check()


@settings(max_examples=150, deadline=None)
@given(size=st.integers(1, 4), decay=st.sampled_from([1.0, 0.9, 0.5]),
       ops=st.lists(st.lists(st.integers(0, E - 1), min_size=1, max_size=4, unique=True), min_size=1, max_size=60))
def test_lfu_evicts_lowest_aged_count(size, decay, ops):
    cache = SlotCache(E, [size], "lfu", decay=decay)
    freq = np.zeros(E)
    for experts in ops:
        freq *= decay
        for e in experts:
            freq[e] += 1
        slots = cache.lookup(0, experts)
        np.testing.assert_allclose(cache.freq[0], freq)
        for e, s in zip(experts, slots):
            if s >= 0:
                continue
            resident = [x for x in np.flatnonzero(cache.slot_of[0] >= 0).tolist()]
            got = cache.admit(0, e)
            if len(resident) < size:
                assert got is not None and got[1] == -1
                continue
            low = min(freq[x] for x in resident)
            if freq[e] <= low:
                assert got is None, "LFU admitted an expert no hotter than every resident one"
            else:
                assert got is not None and freq[got[1]] == low, "LFU evicted an expert that was not the coldest"
        cache.check()


def test_mix_keeps_pins_and_runs_lru_on_the_rest():
    cache = SlotCache(E, [4], "mix")
    for e in (0, 1):
        cache.place(0, e, pin=True)
    for e in (2, 3, 4, 5, 6, 7):
        cache.lookup(0, [e])
        cache.admit(0, e)
        cache.check()
    assert set(np.flatnonzero(cache.slot_of[0] >= 0).tolist()) == {0, 1, 6, 7}
    assert cache.evictions == 4


def test_table_mirrors_host_state_and_static_admits_nothing():
    cache = SlotCache(E, [2, 0], "static")
    cache.place(0, 3, pin=True)
    assert cache.admit(0, 5) is None and cache.admit(1, 5) is None
    assert cache.table[0, 3].item() == cache.slot_of[0, 3] >= 0
    with pytest.raises(ValueError):
        SlotCache(E, [1], "fifo")
