"""The private host channel (transports/channel.py) on CPU/gloo: pair connections that one
end abandoned (an execute that timed out alone) must not strand the next execute. Headers
between processes of one host go through the host mailbox; `gloo` runs them over gloo as
between hosts."""
from __future__ import annotations

import time
import uuid

import pytest
import torch.distributed as dist
from _cases import bits_equal
from _dist import run_ranks
from test_trust import _pair_plan, _try

import reshard_ext as rx


def gloo_headers(p) -> None:
    """This rank's headers of p's channel over gloo, as between hosts (every rank must call
    it before the same execute, and decide_afresh after)."""
    ch = p.transport.channel
    ch._local.update({peer: False for peer in range(ch.size) if peer != ch.rank})
    ch._splits.clear()


def decide_afresh(ch) -> None:
    """The channel's way to each peer decided again at its next header exchange."""
    ch._local.clear()
    ch._splits.clear()


def _solo_timeouts(rank: int, world: int, token: str, rounds: int, timeout: float, headers: str):
    """Ranks take turns executing alone with a short timeout, each once the other gave up;
    then both execute together."""
    p, out, want = _pair_plan(rank, world)
    if headers == "gloo":
        gloo_headers(p)
    store = dist.distributed_c10d._get_default_store()
    rx.execute(p)  # a connected pair to start from
    alone = []
    for i in range(rank, rounds, world):
        if i:
            store.wait([f"{token}/{i - 1}"])
        t0 = time.monotonic()
        alone.append((_try(rx.execute, p, timeout=timeout), time.monotonic() - t0))
        store.set(f"{token}/{i}", "1")
    store.wait([f"{token}/{rounds - 1}"])
    together = _try(rx.execute, p, version=7, timeout=5)
    decide_afresh(p.transport.channel)
    return alone, together, p.version, bits_equal(out, want)


@pytest.mark.parametrize("headers", ["mailbox", "gloo"])
def test_executes_timing_out_alone_on_new_connections_leave_the_plan_usable(headers):
    """gloo: after a timeout each end moves the pair to a new generation (connection), and the
    next rank to execute alone arrives there first. Posting there alone blocked gloo's passive
    end of the lazy connection for minutes past the execute's timeout, or left headers that
    the other end's next execute took for its peer's. Which end is passive is gloo's choice
    (by port), a new draw on each new generation: 16 rounds make 7 draws. mailbox: a header
    left by an end that timed out is withdrawn, never taken by the other end's next execute."""
    timeout = 0.3
    rounds = 16
    for rank, (alone, together, version, ok) in enumerate(run_ranks(2, _solo_timeouts, uuid.uuid4().hex, rounds,
                                                                     timeout, headers, timeout=120)):
        for error, elapsed in alone:
            assert error is not None and f"sent no execute header within {timeout:g} s" in error, (rank, error)
            assert elapsed < timeout + 3, (rank, elapsed)
        assert together is None and version == 7 and ok, (rank, together)


class _SendsSeemDone:
    """A gloo context whose sends report completion at once: what gloo does where a send
    meets a receive that the peer posted before closing the connection, while this end has
    not yet read the close (a loaded machine)."""

    def __init__(self, ctx):
        self.ctx = ctx

    def send(self, tensors, peer, tag):
        return self

    def recv(self, tensors, peer, tag):
        return self.ctx.recv(tensors, peer, tag)

    def wait(self, timeout=None):
        return True


def _closed_after_a_send_completed(rank: int, world: int, token: str):
    """Rank 0 times out alone (closing the pair); rank 1's next execute sees its header
    send complete on that closed connection and its receive fail."""
    p, out, want = _pair_plan(rank, world)
    gloo_headers(p)
    ch = p.transport.channel
    store = dist.distributed_c10d._get_default_store()
    rx.execute(p)  # a connected pair to start from
    if rank == 0:
        alone = _try(rx.execute, p, timeout=1.0)
        store.set(token, "1")
        together = _try(rx.execute, p, version=3, timeout=5)
    else:
        store.wait([token])
        gen = ch._gen.get(0, 0)
        ch._contexts[gen] = _SendsSeemDone(ch._contexts[gen])
        try:
            alone = None
            together = _try(rx.execute, p, version=3, timeout=5)
        finally:
            ch._contexts[gen] = ch._contexts[gen].ctx
    decide_afresh(ch)
    return alone, together, p.version, bits_equal(out, want)


def test_a_send_completing_on_a_connection_the_peer_closed_does_not_end_the_exchange():
    """Headers over gloo (between hosts). The receive failing shows the peer closed the pair
    earlier (its own timeout), so it waits on the next generation: this end must retry there
    too, not give up at once."""
    results = run_ranks(2, _closed_after_a_send_completed, uuid.uuid4().hex, timeout=120)
    assert results[0][0] is not None and "sent no execute header within 1 s" in results[0][0]
    for rank, (_, together, version, ok) in enumerate(results):
        assert together is None and version == 3 and ok, (rank, together)


def _header_paths(rank: int, world: int):
    """Which way an execute's headers go between two processes of this host."""
    from reshard_ext.transports.channel import HEADER_TAG

    p, out, want = _pair_plan(rank, world)
    ch = p.transport.channel
    tags = []
    exchange = ch.exchange
    ch.exchange = lambda ops, tag, *a, **k: tags.append(tag) or exchange(ops, tag, *a, **k)
    try:
        rx.execute(p, version=1)
    finally:
        del ch.exchange
    return ch.local(1 - rank), HEADER_TAG in tags, p.version, bits_equal(out, want)


def test_headers_between_processes_of_one_host_skip_gloo():
    for local, over_gloo, version, ok in run_ranks(2, _header_paths):
        assert local and not over_gloo and version == 1 and ok
