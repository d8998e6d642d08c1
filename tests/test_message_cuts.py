"""Both ends of every pair cut a batch's ops into the same messages, from the tables alone
(no process group): the sizes a sender posts to a peer are the sizes that peer posts to
receive (gloo and NCCL need them equal), in every verify round too (ExecTables::
round_messages), and with direct_bytes 0 (NVSHMEM) there is one message per pair and
batch. Pieces get made-up addresses: bind reads none, it only checks and records them,
so a source piece can share memory with a destination on its rank (in-place refits,
relay replicas) in any plan the memory rules accept."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _boxes import BOX
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard_ext as rx
from reshard_ext import _C, Layout, Mesh, Replicate, Shard
from reshard_ext.errors import InternalError
from reshard_ext.layout import code_of
from reshard_ext.options import Options
from reshard_ext.planning import _plan_rank, _table
from reshard_ext.transports.nvshmem import check_one_message_per_pair

VERIFY_ROUNDS = _C.verify_rounds(1)  # the most rounds a verified batch is cut into

_SPAN = 1 << 32  # bytes between made-up pieces: none overlaps another unless placed so


def _ref(rank: int, name: str, side: int, src: dict[str, Layout], dst: dict[str, Layout],
         in_place: frozenset) -> _C.TensorRef:
    """A made-up TensorRef of `rank`'s contiguous piece of `name` (side 0: source, 1: destination)."""
    lay = (src, dst)[side][name]
    shape = list(lay.local_shape(rank) or ())
    strides = [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape))]
    slot = 2 * sorted(src | dst).index(name) + (1 if (rank, name) in in_place else side)
    return _C.TensorRef(((rank + 1) << 48) + slot * _SPAN, strides, code_of(lay.dtype), shape=shape, name=name)


def bind_all(src: dict[str, Layout], dst: dict[str, Layout], world: int, direct_bytes: int,
             max_batch_bytes: int | None = None, in_place: frozenset = frozenset()) -> list | None:
    """Every rank's ExecTables, planned with the batch count all ranks agree on and bound
    to made-up addresses; (rank, name) in `in_place`: that rank's source piece of `name`
    starts where its destination piece does. None where a rank's bind refuses the
    memory (the plan never runs)."""
    src_t, dst_t = _table(src), _table(dst)
    assert not _C.check_tables(src_t, dst_t, world)
    planned = [_plan_rank(src_t, dst_t, r, max_batch_bytes, 1, 16, Options()) for r in range(world)]
    k = max(wanted for _, wanted in planned)
    if min(wanted for _, wanted in planned) == 0:
        return None  # max_batch_bytes too small: rx.plan refuses it
    tables = []
    for r, (p, _) in enumerate(planned):
        p.assign_batches(k)
        t = _C.ExecTables(p)
        staging = [((r + 1) << 48) - (j + 1) * _SPAN for j in range(4)]
        try:
            t.bind([_ref(r, src_t.name(i), 0, src, dst, in_place) for i in t.src_used],
                   [_ref(r, dst_t.name(i), 1, src, dst, in_place) for i in t.dst_used],
                   staging[:2], staging[2:], direct_bytes)
        except rx.ReshardError:
            return None
        tables.append(t)
    return tables


PIECE = 8 * 16384  # a verify round of gloo (ExecTables::round_messages, piece mode) small enough to cut 1 MiB


def cuts(tables: list, b: int, rounds: tuple | None) -> tuple[dict, dict]:
    """{(sender, receiver): message sizes} of batch b (round r of `rounds`, or of
    `piece`-byte rounds, or whole) as the senders and as the receivers see them."""
    sent: dict = {}
    received: dict = {}
    for me, t in enumerate(tables):
        if rounds is None:
            sends, recvs = t.messages(b)
        elif rounds[0] == "piece":  # each rank runs its own number of rounds
            r, piece = rounds[1], rounds[2]
            n = t.piece_rounds(b, piece)
            sends, recvs = t.round_messages(b, r, n, piece) if r < n else ([], [])
        else:
            sends, recvs = t.round_messages(b, rounds[0], rounds[1])
        for m in sends:
            sent.setdefault((me, m.peer), []).append(m.bytes)
        for m in recvs:
            received.setdefault((m.peer, me), []).append(m.bytes)
    return sent, received


def _direct_pieces_tile(t, b: int, piece: int) -> None:
    """Each direct send and receive moves whole over the rounds, its ordinals in order."""
    cut = [(r, VERIFY_ROUNDS, 0) for r in range(VERIFY_ROUNDS)]
    n = t.piece_rounds(b, piece)
    for rounds in (cut, [(r, n, piece) for r in range(n)]):
        for whole, per_round in ((t.direct_recv_boxes(b), t.direct_recv_round_boxes),
                                 (t.direct_send_boxes(b), t.direct_send_round_boxes)):
            pieces = [np.frombuffer(per_round(b, *r), dtype=BOX) for r in rounds]
            for j, box in enumerate(np.frombuffer(whole, dtype=BOX)):
                at = 0
                for per in pieces:
                    if per[j]["shape"][0] > 0:
                        assert per[j]["param"][0] == at
                        at += int(per[j]["shape"][0])
                assert at == int(np.prod(box["shape"][: int(box["ndim"])]))


def assert_ends_agree(tables: list) -> None:
    for b in range(tables[0].num_batches):
        most = max(t.piece_rounds(b, PIECE) for t in tables)
        for rounds in [None] + [(r, VERIFY_ROUNDS) for r in range(VERIFY_ROUNDS)] + \
                [("piece", r, PIECE) for r in range(most)]:
            sent, received = cuts(tables, b, rounds)
            assert sent == received, f"batch {b}, round {rounds}: senders cut {sent}, receivers {received}"
        for t in tables:
            _direct_pieces_tile(t, b, PIECE)
            n = t.piece_rounds(b, PIECE)
            for side in (0, 1):  # a pair's stream is cut at most once per round boundary
                whole = t.messages(b)[side]
                peers = len({m.peer for m in whole})
                for count, pieces in ((VERIFY_ROUNDS, [t.round_messages(b, r, VERIFY_ROUNDS)[side]
                                                       for r in range(VERIFY_ROUNDS)]),
                                      (n, [t.round_messages(b, r, n, PIECE)[side] for r in range(n)])):
                    assert sum(map(len, pieces)) <= len(whole) + (count - 1) * peers


# ---- A: aliasing must not change the cut ------------------------------------------------

N = 1 << 18  # float32 elements: a 1 MiB half of x


def _swap_case() -> tuple[dict, dict]:
    """x's halves swap between ranks 0 and 1; y (32 bytes) goes 0 -> 1 beside it."""
    src = {"x": Layout((2 * N,), torch.float32, Mesh([0, 1]), [Shard(0)]),
           "y": Layout((8,), torch.float32, Mesh([0]), [Replicate()])}
    dst = {"x": Layout((2 * N,), torch.float32, Mesh([1, 0]), [Shard(0)]),
           "y": Layout((8,), torch.float32, Mesh([1]), [Replicate()])}
    return src, dst


@pytest.mark.parametrize("direct_bytes", [1, 1 << 20, 64 << 20])
def test_in_place_on_one_end_cuts_alike(direct_bytes):
    """Rank 0 refits x in place (its source half is where its destination half goes),
    rank 1 does not. Rank 0's x send stays staged (its reads must all come before the
    writes), yet it must stay a message of its own as rank 1 cuts it: once it was packed
    with y into one 1 MiB + 32 B message while rank 1 posted 1 MiB and 32 B (gloo aborted
    the process on the size mismatch; verify rounds disagreed even without y)."""
    src, dst = _swap_case()
    tables = bind_all(src, dst, 2, direct_bytes, in_place=frozenset({(0, "x")}))
    assert tables is not None, "the memory rules accept this plan"
    assert_ends_agree(tables)
    if direct_bytes == 1 << 20:
        sends, recvs = tables[0].messages(0)
        assert sorted(m.bytes for m in sends) == [32, 4 * N] and [m.bytes for m in recvs] == [4 * N]
        assert not tables[0].direct_sends(0) and not tables[0].direct_recvs(0)  # aliased: staged both ways
        assert tables[1].direct_sends(0) and tables[1].direct_recvs(0)


def _refit_in_place(rank, world, device="cpu"):
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    src, dst = _swap_case()
    full = torch.arange(2 * N, dtype=torch.float32, device=dev)
    xs = full[rank * N:(rank + 1) * N].clone()
    xd = xs if rank == 0 else torch.zeros(N, device=dev)  # rank 0 in place
    s, d = {"x": (xs, src["x"])}, {"x": (xd, dst["x"])}
    y = torch.arange(8, dtype=torch.float32, device=dev)
    if rank == 0:
        s["y"] = (y, src["y"])
    else:
        d["y"] = (torch.zeros(8, device=dev), dst["y"])
    plan = rx.plan(s, d, options=rx.Options(timeout=60, tuning=rx.Tuning(direct_bytes=1 << 20)),
                   backend="nccl" if device == "cuda" else "auto")  # NCCL's direct messages, not the direct transport
    ok = []
    for verify in (False, True):
        xs.copy_(full[rank * N:(rank + 1) * N])  # rank 0's last refit overwrote its source
        rx.execute(plan, verify=verify)
        ok.append(torch.equal(xd, full[N:] if rank == 0 else full[:N]) and (rank == 0 or torch.equal(d["y"][0], y)))
    return ok == [True, True]


def test_in_place_on_one_end_refits():
    """The case above end to end over gloo (it aborted the process before the fix)."""
    from _dist import run_ranks

    assert all(run_ranks(2, _refit_in_place))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and rx.build_info()["cuda"]),
                    reason="needs 2 GPUs and reshard_ext built with CUDA")
def test_in_place_on_one_end_refits_cuda():
    """NCCL: the verified execute moves x in rounds; both ends must cut them alike."""
    from _dist import run_ranks

    assert all(run_ranks(2, _refit_in_place, "cuda", backend="nccl"))


def _direct_bytes_apart(rank, world):
    src, dst = _swap_case()
    x = torch.zeros(N)
    try:
        rx.plan({"x": (x, src["x"])}, {"x": (torch.zeros(N), dst["x"])},
                options=rx.Options(tuning=rx.Tuning(direct_bytes=1 << 20 if rank == 0 else 1 << 21)))
    except rx.ReshardError as e:
        return str(e)
    return ""


def test_direct_bytes_must_be_alike():
    """The other input of the cut: one rank's direct_bytes apart from its peer's would
    post different message sizes (gloo aborts the process); rx.plan refuses it on every rank."""
    from _dist import run_ranks

    for msg in run_ranks(2, _direct_bytes_apart):
        assert "RESHARD_EXT_CPU_DIRECT_BYTES must be alike" in msg and "1048576: [0], 2097152: [1]" in msg, msg


DTYPES = [torch.float32, torch.bfloat16]


@st.composite
def layout(draw, shape: tuple[int, ...], dtype: torch.dtype, world: int) -> Layout:
    n = draw(st.integers(1, world))
    ranks = draw(st.permutations(range(world)))[:n]
    mesh = Mesh(list(ranks))
    kind = draw(st.sampled_from(["replicate", "shard", "uneven"]))
    dim = draw(st.integers(0, len(shape) - 1))
    if kind == "replicate":
        p = Replicate()
    elif kind == "shard" or n == 1:
        p = Shard(dim)
    else:
        cut = sorted(draw(st.lists(st.integers(0, shape[dim]), min_size=n - 1, max_size=n - 1)))
        p = Shard(dim, blocks=tuple(b - a for a, b in zip([0] + cut, cut + [shape[dim]])))
    lay = Layout(shape, dtype, mesh, [p])
    assert not lay.error, lay.error
    return lay


@st.composite
def refits(draw):
    """Tensors of 1 KiB to 2 MiB (several verify-round aligns), split evenly or not, cast
    or not, with in-place pieces drawn among the ranks holding both ends of a tensor."""
    world = draw(st.integers(2, 4))
    src, dst = {}, {}
    for i in range(draw(st.integers(1, 5))):
        rows = draw(st.sampled_from([1, 3, 64, 1024]))
        cols = draw(st.sampled_from([256, 512]))
        shape = (rows, cols) if draw(st.booleans()) else (rows * cols,)
        src[f"t{i}"] = s = draw(layout(shape, draw(st.sampled_from(DTYPES)), world))
        if draw(st.booleans()):
            dst[f"t{i}"] = draw(layout(shape, draw(st.sampled_from(DTYPES)), world))
        else:  # the same split over other ranks: a rank's piece leaves, another arrives (no same-rank copy)
            ranks = draw(st.permutations(range(world)))
            dst[f"t{i}"] = Layout(shape, draw(st.sampled_from(DTYPES)), Mesh([ranks[r] for r in s.mesh.ranks]),
                                  s.placements)
    both = sorted((r, n) for n in src for r in range(world)
                  if src[n].local_shape(r) is not None and dst[n].local_shape(r) is not None)
    in_place = frozenset(draw(st.lists(st.sampled_from(both), unique=True, min_size=1))
                         if both and draw(st.integers(0, 3)) else [])  # mostly some: without, bind refuses nothing
    direct_bytes = draw(st.sampled_from([1, 4096, 1 << 16, 1 << 20]))
    max_batch = draw(st.sampled_from([None, None, 1 << 16, 1 << 20]))
    return src, dst, world, direct_bytes, max_batch, in_place


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(refits())
def test_both_ends_cut_alike(case):
    src, dst, world, direct_bytes, max_batch, in_place = case
    tables = bind_all(src, dst, world, direct_bytes, max_batch, in_place)
    if tables is not None:  # else the memory rules refuse it: nothing moves
        assert_ends_agree(tables)


# ---- B: NVSHMEM's one message per pair and batch ---------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(refits())
def test_one_message_per_pair_and_batch(case):
    """NVSHMEM binds with direct_bytes 0; many tensors, uneven splits, casts and staging
    bounds that cut the plan into batches still make one message per pair per batch."""
    src, dst, world, _, max_batch, _ = case
    tables = bind_all(src, dst, world, 0, max_batch)
    for rank, t in enumerate(tables or []):  # None: max_batch_bytes below one op
        check_one_message_per_pair(t, rank)


def test_one_message_per_pair_check_names_the_pair():
    M = _C.Message
    two = SimpleNamespace(num_batches=2, messages=lambda b: ([M(1, 0, 8), M(2, 0, 8)], [M(3, 0, 8), M(3, 64, 8)])
                          if b else ([M(1, 0, 8)], []))
    with pytest.raises(InternalError, match=r"rank 5 receives 2 messages from rank 3 in batch 1"):
        check_one_message_per_pair(two, 5)
    empty = SimpleNamespace(num_batches=1, messages=lambda b: ([M(1, 0, 8), M(1, 64, 0)], []))
    check_one_message_per_pair(empty, 0)  # an empty message is never put
