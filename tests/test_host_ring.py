"""_C.HostRing (csrc/comm/host_ring.h): the CPU transport's data between the processes of
one host through shared-memory rings. Rings of several ranks live in one process here and
each end is polled when the test says, so interleavings are the test's choice; the refits
over them (test_refit_cpu.py, test_verify.py) run in real process groups."""
from __future__ import annotations

import os

import numpy as np
import pytest

from reshard_ext import _C
from reshard_ext.errors import ReshardError

SLOTS, SLOT = 2, 4096  # small: streams wrap around the ring many times


def _rings(n: int = 2, slots: int = SLOTS, slot: int = SLOT):
    rings = [_C.HostRing(r, list(range(n)), slots, slot) for r in range(n)]
    for r, ring in enumerate(rings):
        for p, other in enumerate(rings):
            if p != r:
                ring.attach(p, other.name)
    return rings


def _run(rings, limit: int = 100000):
    """Polls every open ring in turn until all are done."""
    for _ in range(limit):
        if all([r.poll(0.0) for r in rings]):
            return
    raise AssertionError("the exchange did not finish")


def _msgs(peer, arrays):
    return [(peer, a.ctypes.data, a.nbytes) for a in arrays]


def _data(seed, sizes):
    g = np.random.default_rng(seed)
    return [g.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def test_streams_both_ways_land_bit_for_bit_across_wraps_and_chunk_edges():
    a, b = _rings()
    sizes_ab, sizes_ba = [1, 4095, 4096, 4097, 30000, 7], [12345, 3, 8192]
    for round_ in range(3):  # the counters go on growing; each exchange starts where the last ended
        out_ab, out_ba = _data(round_, sizes_ab), _data(round_ + 10, sizes_ba)
        in_ab, in_ba = [np.zeros_like(x) for x in out_ab], [np.zeros_like(x) for x in out_ba]
        a.begin(7, _msgs(1, out_ab), _msgs(1, in_ba))
        b.begin(7, _msgs(0, out_ba), _msgs(0, in_ab))
        _run([a, b])
        assert a.unfinished() == [] and b.unfinished() == []
        a.end()
        b.end()
        for x, y in zip(out_ab + out_ba, in_ab + in_ba):
            assert np.array_equal(x, y)


def test_three_ranks_each_sending_to_both_others():
    rings = _rings(3)
    sent = {(s, r): _data(10 * s + r, [5000 + 100 * s, 64]) for s in range(3) for r in range(3) if s != r}
    got = {k: [np.zeros_like(x) for x in v] for k, v in sent.items()}
    for r, ring in enumerate(rings):
        ring.begin(1, [m for p in range(3) if p != r for m in _msgs(p, sent[(r, p)])],
                   [m for p in range(3) if p != r for m in _msgs(p, got[(p, r)])])
    _run(rings)
    for ring in rings:
        ring.end()
    for k in sent:
        assert all(np.array_equal(x, y) for x, y in zip(sent[k], got[k])), k


def test_chunks_an_aborted_execute_left_behind_are_skipped():
    a, b = _rings()
    stale = _data(1, [SLOT * SLOTS])  # fills the ring; b never takes it
    a.begin(5, _msgs(1, stale), [])
    assert a.poll(0.0)
    a.end()
    fresh = _data(2, [3000, 9000])
    got = [np.zeros_like(x) for x in fresh]
    a.begin(6, _msgs(1, fresh), [])
    b.begin(6, [], _msgs(0, got))
    _run([a, b])
    a.end()
    b.end()
    assert all(np.array_equal(x, y) for x, y in zip(fresh, got))


def test_a_chunk_that_does_not_fit_the_receivers_messages_fails_the_pair():
    a, b = _rings()
    out = _data(3, [6000])
    short = [np.zeros(5000, dtype=np.uint8)]
    a.begin(9, _msgs(1, out), [])
    assert a.poll(0.0)
    a.end()
    b.begin(9, [], _msgs(0, short))
    for _ in range(100):
        b.poll(0.0)
    (peer, why), = b.unfinished()
    assert peer == 0 and "does not match" in why, why
    b.end()
    # The next execute's stream is another one: b takes it whole, past the leftovers
    out = _data(4, [700])
    got = [np.zeros(700, dtype=np.uint8)]
    a.begin(10, _msgs(1, out), [])
    b.begin(10, [], _msgs(0, got))
    _run([a, b])
    a.end()
    b.end()
    assert np.array_equal(out[0], got[0])


def test_a_silent_peer_leaves_the_stream_unfinished_until_the_deadline():
    a, b = _rings()
    got = [np.zeros(100, dtype=np.uint8)]
    b.begin(3, [], _msgs(0, got))
    assert not b.poll(0.02)  # returns at its deadline
    assert b.unfinished() == [(0, "")]
    b.end()
    # a sender whose receiver never takes: done once the ring holds what it sends, stuck beyond
    big = _data(5, [SLOT * (SLOTS + 1)])
    a.begin(3, _msgs(1, big), [])
    assert not a.poll(0.02)
    assert a.unfinished() == [(1, "")]
    a.end()


def test_misuse_raises():
    a, b = _rings()
    with pytest.raises(Exception, match="not attached|another rank"):
        a.begin(1, [(5, 0, 10)], [])
    with pytest.raises(Exception, match="must be sorted"):
        _C.HostRing(0, [1, 0], SLOTS, SLOT)
    with pytest.raises(Exception, match="slots"):
        _C.HostRing(0, [0, 1], 1, SLOT)
    c = _C.HostRing(0, [0, 2], SLOTS, SLOT)  # other ranks on the host: the same size, not the same layout
    with pytest.raises(ReshardError, match="not laid out"):
        c.attach(2, b.name)
    d = _C.HostRing(0, [0, 1, 2], SLOTS, SLOT)
    with pytest.raises(ReshardError, match="too small"):
        d.attach(1, b.name)
    a.begin(1, [], [])
    with pytest.raises(Exception, match="still open"):
        a.begin(1, [], [])
    a.end()


def test_the_segment_is_reserved_and_removed_with_its_ring():
    ring = _C.HostRing(0, [0, 1], SLOTS, SLOT)
    path = "/dev/shm" + ring.name
    assert os.path.getsize(path) >= 2 * SLOTS * SLOT and os.stat(path).st_blocks * 512 >= 2 * SLOTS * SLOT
    del ring
    assert not os.path.exists(path)
