"""Bad input: every rank raises ReshardError naming the tensor, before any data moves;
no dst tensor changes, nothing hangs, and the process group is still usable."""
import pytest
import torch
import torch.distributed as dist
from _cases import bits_equal
from _dist import run_ranks

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Replicate, Shard

F32 = torch.float32


def _entries(kind: str, rank: int, world: int):
    """(src, dst, tensor name the message must mention) for one kind of bad input."""
    shape = (8, 4)
    good_src = Layout(shape, F32, Mesh([0, 1]), [Shard(0)])
    good_dst = Layout(shape, F32, Mesh(list(range(world))), [Shard(0)])
    src_l, dst_l, name = good_src, good_dst, "w"
    src_t = lambda l: torch.randn(l.local_shape(rank)) if rank in l.mesh else None  # noqa: E731
    dst_t = lambda l: torch.full(l.local_shape(rank), 3.0, dtype=l.dtype) if rank in l.mesh else None  # noqa: E731
    src_name, dst_name = name, name
    extra_src = {}
    if kind == "unknown_name":
        dst_name = "w_missing"
    elif kind == "shape_mismatch":
        dst_l = Layout((8, 5), F32, Mesh(list(range(world))), [Shard(0)])
    elif kind == "float_int_cast":
        dst_l = Layout(shape, torch.int32, Mesh(list(range(world))), [Shard(0)])
    elif kind == "strided_not_divisible":
        src_l = Layout(shape, F32, Mesh([0, 1]), [Shard(0, stride=3)])
    elif kind == "blocks_wrong_sum":
        src_l = Layout(shape, F32, Mesh([0, 1]), [Shard(0, blocks=(4, 2))])
    elif kind == "sizes_wrong_sum":
        src_l = Layout(shape, F32, Mesh([0, 1]), [Shard(0, sizes=(6, 3))])
    elif kind == "rank_outside_group":
        src_l = Layout(shape, F32, Mesh([0, world + 3]), [Shard(0)])
    elif kind == "disagree":
        src_l = Layout(shape, F32, Mesh([0, 1]), [Shard(0)] if rank == 0 else [Shard(1)])
    elif kind == "mesh_rank_passes_nothing":
        pass  # rank 1 drops its piece below
    elif kind == "not_in_mesh":
        extra_src = {name: (torch.randn(4, 4), src_l)} if rank == 2 else {}
    elif kind == "fp8_cast":
        dst_l = Layout(shape, torch.float8_e4m3fn, Mesh(list(range(world))), [Shard(0)])
    elif kind == "mesh_beyond_group":  # every rank of the group holds a piece; the mesh names one more
        dst_l = Layout(shape, F32, Mesh(list(range(world + 1))), [Shard(0)])
    elif kind in ("local_shape", "local_dtype"):
        pass
    else:
        raise AssertionError(kind)

    src = {}
    if rank in src_l.mesh and not (kind == "mesh_rank_passes_nothing" and rank == 1):
        t = src_t(src_l) if not src_l.error else torch.randn(4, 4)
        if kind == "local_shape" and rank == 1:
            t = torch.randn(5, 4)
        if kind == "local_dtype" and rank == 0:
            t = t.double()
        src[src_name] = (t, src_l)
    src.update(extra_src)
    dst = {dst_name: (dst_t(dst_l), dst_l)} if rank in dst_l.mesh else {}
    return src, dst, name


KINDS = [
    "unknown_name", "shape_mismatch", "float_int_cast", "strided_not_divisible", "blocks_wrong_sum", "sizes_wrong_sum",
    "rank_outside_group", "disagree", "mesh_rank_passes_nothing", "not_in_mesh", "local_shape", "local_dtype",
    "fp8_cast", "mesh_beyond_group",
]

# What the message of some kinds must say, beyond naming the tensor.
EXPLAINED = {
    "fp8_cast": "conversions exist only among float16, bfloat16, float32 and float64",
    "sizes_wrong_sum": "shard sizes sum to 9 but dim 0 has length 8",
    "mesh_beyond_group": "its mesh names ranks [4] outside the process group (group ranks are 0..3",
}


def _try_bad(rank: int, world: int, kind: str):
    src, dst, name = _entries(kind, rank, world)
    before = {n: t.clone() for n, (t, _) in dst.items()}
    message = None
    try:
        rx.execute(rx.plan(src, dst))
    except rx.ReshardError as e:
        message = str(e)
    unchanged = all(bits_equal(t, before[n]) for n, (t, _) in dst.items())
    # The group still works: a collective and a good refit afterwards.
    t = torch.ones(1)
    dist.all_reduce(t)
    good_src = Layout((4, 4), F32, Mesh([0]), [Replicate()])
    good_dst = Layout((4, 4), F32, Mesh(list(range(world))), [Shard(0)])
    g = torch.arange(16.0).reshape(4, 4)
    out = {"ok": (torch.zeros(good_dst.local_shape(rank)), good_dst)}
    rx.execute(rx.plan({"ok": (g.clone(), good_src)} if rank == 0 else {}, out))
    return message, unchanged, t.item() == world and bits_equal(out["ok"][0], good_dst.local_part(g, rank)), name


@pytest.mark.parametrize("kind", KINDS)
def test_bad_input_raises_everywhere(kind):
    results = run_ranks(4, _try_bad, kind, timeout=120)
    for rank, (message, unchanged, usable, name) in enumerate(results):
        assert message is not None, f"rank {rank} did not raise for {kind}"
        assert f"'{name}" in message or f"'{name}_missing'" in message, message
        assert EXPLAINED.get(kind, "") in message, message
        assert unchanged, f"rank {rank}: a dst tensor changed"
        assert usable, f"rank {rank}: group unusable after the error"


def test_local_plan_raises_on_bad_tables():
    src = {"w": Layout((8, 4), F32, Mesh([0, 1]), [Shard(0, stride=3)])}
    dst = {"w": Layout((8, 4), F32, Mesh([0]), [Replicate()])}
    with pytest.raises(rx.ReshardError, match="'w'"):
        rx.local_plan(src, dst, 0)


def test_shard_dim_out_of_range_raises_at_the_layout():
    """A mistake the layout alone shows raises where it is made, not at rx.plan."""
    with pytest.raises(rx.ReshardError, match=r"Shard\(-3\) of a 2-d tensor \(dims are -2 to 1\)"):
        Layout((8, 4), F32, Mesh([0, 1]), [Shard(-3)])


def test_layout_helpers_raise_on_invalid():
    bad = Layout((8, 4), F32, Mesh([0, 1]), [Shard(0, stride=3)])
    assert "divisible" in bad.error
    with pytest.raises(rx.ReshardError):
        bad.local_shape(0)
    with pytest.raises(rx.ReshardError):
        Mesh([[0, 1], [2]])


def _skip_execute(rank: int, world: int, timeout_s: float):
    src_l = Layout((4, 4), F32, Mesh([0]), [Replicate()])
    dst_l = Layout((4, 4), F32, Mesh([1]), [Replicate()])
    src = {"w": (torch.ones(4, 4), src_l)} if rank == 0 else {}
    dst = {"w": (torch.zeros(4, 4), dst_l)} if rank == 1 else {}
    p = rx.plan(src, dst)
    try:
        if rank == 1:
            outcome = "skipped"  # never posts its receive: rank 0 must not wait forever
        else:
            rx.execute(p, timeout=timeout_s)  # per call: rx.plan keeps the default, ranks may arrive late
            outcome = "no error"
    except rx.ReshardError as e:
        outcome = str(e)
    # Both the caller's group and the plan still work afterwards.
    t = torch.ones(1)
    dist.all_reduce(t)
    rx.execute(p)
    return outcome, t.item(), bits_equal(dst["w"][0], torch.ones(4, 4)) if dst else True


def test_peer_that_skips_execute_raises_instead_of_hanging():
    results = run_ranks(3, _skip_execute, 3.0, timeout=120)
    assert results[1][0] == "skipped"
    assert "rank 1 sent no execute header within 3 s" in results[0][0], results[0][0]
    assert results[0][0] == results[2][0]  # one answer on every rank that called it
    assert all(total == 3 and ok for _, total, ok in results)


def _unknown_backends(rank: int, world: int):
    out = []
    lay = Layout((4,), F32, Mesh([0]), [Replicate()])
    for backend in ("nvshmem", "carrier-pigeon"):
        try:
            rx.plan({"w": (torch.ones(4), lay)} if rank == 0 else {}, {"w": (torch.zeros(4), lay)} if rank == 0 else {},
                    backend=backend)
            out.append("no error")
        except rx.ReshardError as e:
            out.append(str(e))
    return out


def test_backends_not_available_raise_on_every_rank():
    for nvshmem, bogus in run_ranks(2, _unknown_backends):
        # here (no GPU) every rank misses CUDA, or the CUDA build, and each says so
        assert "backend 'nvshmem' cannot run on every rank" in nvshmem, nvshmem
        assert "rank 0: " in nvshmem and "rank 1: " in nvshmem and "CUDA" in nvshmem, nvshmem
        assert "unknown backend" in bogus


def _bind_fails_on_one_rank(rank: int, world: int):
    """Rank 1 cannot allocate its staging buffers (as on a GPU out of memory)."""
    from reshard_ext.transports.cpu import CpuTransport

    layout = Layout((8, 4), F32, Mesh(list(range(world))), [Shard(0)])
    other = Layout((8, 4), F32, Mesh(list(range(world))), [Shard(1)])
    src = {"w": (torch.randn(layout.local_shape(rank)), layout)}
    dst = {"w": (torch.zeros(other.local_shape(rank)), other)}
    real = CpuTransport.bind

    def failing_bind(self, tables):
        raise MemoryError("staging: out of memory (simulated)")

    if rank == 1:
        CpuTransport.bind = failing_bind
    try:
        rx.plan(src, dst)
        outcome = "planned"
    except MemoryError as e:
        outcome = f"MemoryError: {e}"
    except rx.ReshardError as e:
        outcome = f"ReshardError: {e}"
    finally:
        CpuTransport.bind = real
    t = torch.ones(1)
    dist.all_reduce(t)  # the group is still usable
    return outcome, float(t)


def test_setup_failure_on_one_rank_raises_everywhere():
    results = run_ranks(4, _bind_fails_on_one_rank, timeout=120)  # not 3: that pool is left broken above
    for rank, (outcome, total) in enumerate(results):
        assert total == 4.0
        if rank == 1:
            assert outcome.startswith("MemoryError"), outcome
        else:
            assert outcome.startswith("ReshardError") and "rank 1" in outcome, outcome


# --- memory rules (bind time) ------------------------------------------------------------

def _global(shape, seed=3):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _swap_in_place(rank: int, world: int, rows: int, max_batch_bytes):
    """Ranks 0 and 1 swap halves, each writing its destination into the very memory
    it sends from (dst piece == src piece)."""
    shape = (2 * rows, 1024)
    src_l = Layout(shape, F32, Mesh([0, 1]), [Shard(0)])
    dst_l = Layout(shape, F32, Mesh([1, 0]), [Shard(0)])
    g = _global(shape)
    t = src_l.local_part(g, rank).clone()
    try:
        p = rx.plan({"w": (t, src_l)}, {"w": (t, dst_l)}, max_batch_bytes=max_batch_bytes)
    except rx.ReshardError as e:
        return str(e), bits_equal(t, src_l.local_part(g, rank))
    rx.execute(p)
    rx.execute(p)  # and back
    return None, bits_equal(t, src_l.local_part(g, rank))


@pytest.mark.parametrize("rows", [4, 256])  # 16 KB pieces, and 1 MiB ones (sent as direct messages otherwise)
def test_destination_that_is_its_source_swaps_correctly(rows):
    for message, ok in run_ranks(2, _swap_in_place, rows, None):
        assert message is None and ok


def test_destination_that_is_its_source_over_several_batches_is_refused():
    for message, unchanged in run_ranks(2, _swap_in_place, 256, 256 << 10):
        assert "'w'" in message and "share memory" in message and "batches" in message, message
        assert unchanged


def _alias_cases(rank: int, world: int, kind: str):
    shape = (8, 6)
    lay = Layout(shape, F32, Mesh(list(range(world))), [Replicate()])
    by_rows = Layout(shape, F32, Mesh(list(range(world))), [Shard(0)])
    src = {"w": (_global(shape), lay), "v": (_global(shape, 4), lay)}
    out = torch.zeros(shape)
    if kind == "expanded":  # one row of memory for every row of the piece
        dst = {"w": (torch.zeros(1, 6).expand(8, 6), lay)}
    elif kind == "two_names_one_storage":
        dst = {"w": (out, lay), "v": (out.view(8, 6), lay)}
    elif kind == "overlapping_views":
        buf = torch.zeros(60)
        dst = {"w": (buf[:48].view(8, 6), lay), "v": (buf[12:].view(8, 6), lay)}
    elif kind == "copy_onto_other_source":  # same-rank copies would read what others write
        buf = torch.zeros(48)
        src = {"w": (buf.view(8, 6), lay), "v": (_global(shape, 4), lay)}
        dst = {"w": (_global(shape, 5), lay), "v": (buf.view(8, 6), lay)}
    elif kind == "column_blocks":  # interleaved but disjoint: accepted
        whole = torch.zeros(8, 12)
        dst = {"w": (whole[:, :6], lay), "v": (whole[:, 6:], lay)}
    elif kind == "identity":  # a destination that is its own source, same layout: nothing to move
        t = _global(shape)
        src = {"w": (t, lay), "v": (_global(shape, 4), lay)}
        dst = {"w": (t, lay)}
    elif kind == "rows_of_one_buffer":  # disjoint pieces of one storage: accepted
        whole = torch.zeros(2 * by_rows.local_shape(rank)[0], 6)
        half = by_rows.local_shape(rank)[0]
        dst = {"w": (whole[:half], by_rows), "v": (whole[half:], by_rows)}
    else:
        raise AssertionError(kind)
    before = {n: t.clone() for n, (t, _) in dst.items()}
    try:
        p = rx.plan(src, dst)
    except rx.ReshardError as e:
        unchanged = all(bits_equal(t, before[n]) for n, (t, _) in dst.items())
        return str(e), unchanged
    rx.execute(p)
    ok = all(bits_equal(t, l.local_part(src[n][0], rank)) for n, (t, l) in dst.items())
    return None, ok


@pytest.mark.parametrize("kind,names", [
    ("expanded", ["'w'", "overlap in memory"]),
    ("two_names_one_storage", ["'w'", "'v'", "share memory"]),
    ("overlapping_views", ["'w'", "'v'", "share memory"]),
    ("copy_onto_other_source", ["'v'", "'w'", "same-rank copies"]),
])
def test_overlapping_destinations_are_refused_everywhere(kind, names):
    for rank, (message, unchanged) in enumerate(run_ranks(2, _alias_cases, kind)):
        assert message is not None and all(n in message for n in names), (rank, message)
        assert unchanged


@pytest.mark.parametrize("kind", ["column_blocks", "identity", "rows_of_one_buffer"])
def test_disjoint_views_of_one_storage_are_accepted(kind):
    for message, ok in run_ranks(2, _alias_cases, kind):
        assert message is None and ok, message


# --- malformed arguments on one rank only ----------------------------------------------------

def _malformed_on_rank_1(rank: int, world: int, kind: str, timeout_s: float):
    import time

    lay = Layout((8, 4), F32, Mesh(list(range(world))), [Shard(0)])
    src = {"w": (torch.randn(lay.local_shape(rank)), lay)}
    dst = {"w": (torch.zeros(lay.local_shape(rank)), lay)}
    args = {"max_batch_bytes": None, "options": rx.Options(timeout=timeout_s)}
    if rank == 1:
        if kind == "non_str_name":
            src = {7: src["w"]}
        elif kind == "src_as_list":
            src = [src["w"]]
        elif kind == "negative_max_batch_bytes":
            args["max_batch_bytes"] = -5
        elif kind == "float_max_batch_bytes":
            args["max_batch_bytes"] = 1.5e6
        elif kind == "meta_tensor":
            src = {"w": (torch.empty(lay.local_shape(rank), device="meta"), lay)}
        elif kind == "layout_not_a_layout":
            src = {"w": (src["w"][0], "Shard(0)")}
    t0 = time.monotonic()
    try:
        rx.plan(src, dst, **args)
        message = None
    except rx.ReshardError as e:
        message = str(e)
    elapsed = time.monotonic() - t0
    t = torch.ones(1)
    dist.all_reduce(t)
    return message, elapsed, t.item()


@pytest.mark.parametrize("kind", ["non_str_name", "src_as_list", "negative_max_batch_bytes", "float_max_batch_bytes",
                                  "meta_tensor", "layout_not_a_layout"])
def test_malformed_argument_on_one_rank_raises_on_every_rank(kind):
    # A 60 s reshard timeout: raising on the other ranks must come from the exchange, not a timeout.
    for rank, (message, elapsed, total) in enumerate(run_ranks(4, _malformed_on_rank_1, kind, 60.0)):
        assert message is not None and "rank 1" in message, (rank, message)
        assert elapsed < 30, (rank, elapsed)
        assert total == 4


# --- max_batch_bytes -------------------------------------------------------------------------

def _staging(rank: int, world: int, limit: int):
    # Every rank sends and receives (rows to columns): both buffers count.
    src_l = Layout((256, 64), F32, Mesh(list(range(world))), [Shard(0)])
    dst_l = Layout((256, 64), F32, Mesh(list(range(world))), [Shard(1)])
    g = _global((256, 64))
    dst = torch.zeros(dst_l.local_shape(rank))
    p = rx.plan({"w": (src_l.local_part(g, rank), src_l)}, {"w": (dst, dst_l)}, max_batch_bytes=limit)
    rx.execute(p)
    return p.staging_bytes, p.num_batches, p.bytes_sent, p.bytes_received, bits_equal(dst, dst_l.local_part(g, rank))


@pytest.mark.parametrize("limit", [4096, 16384, 1 << 20])
def test_max_batch_bytes_bounds_send_plus_receive_staging(limit):
    for staging, batches, sent, received, ok in run_ranks(4, _staging, limit):
        assert ok
        assert sent > 0 and received > 0
        assert 0 < staging <= limit, (staging, limit)
        if sent + received > limit:
            assert batches > 1


def test_max_batch_bytes_too_small_raises():
    with pytest.raises(rx.ReshardError, match="too small"):
        lay = Layout((8, 64), F32, Mesh([0, 1, 2]), [Shard(1)])
        rx.local_plan({"w": lay}, {"w": Layout((8, 64), F32, Mesh([0, 1, 2]), [Shard(0)])}, 0, max_batch_bytes=64)


# --- checked arithmetic -------------------------------------------------------------------

@pytest.mark.parametrize("shape,dtype,what", [
    ((1 << 40, 1 << 40), F32, "number of elements"),
    ((1 << 62,), F32, "bytes of the tensor"),
    ((1 << 31, 1 << 31, 4), torch.bfloat16, "number of elements"),
    ((1 << 61, 2, 2), torch.uint8, "overflows"),
])
def test_sizes_that_overflow_int64_raise(shape, dtype, what):
    src = Layout(shape, dtype, Mesh([0, 1]), [Shard(0)])
    dst = Layout(shape, dtype, Mesh([0]), [Replicate()])
    with pytest.raises(rx.ReshardError, match=what):
        rx.local_plan({"w": src}, {"w": dst}, 0)


def test_byte_totals_that_overflow_int64_raise():
    # Each tensor fits (2**62 bytes), four of them to one rank do not.
    lay_s = Layout((1 << 61, 2), torch.uint8, Mesh([1]), [Replicate()])
    lay_d = Layout((1 << 61, 2), torch.uint8, Mesh([0]), [Replicate()])
    with pytest.raises(rx.ReshardError, match="overflows a 64-bit integer"):
        rx.local_plan({f"t{i}": lay_s for i in range(4)}, {f"t{i}": lay_d for i in range(4)}, 0)


def test_out_of_range_integers_raise():
    with pytest.raises(rx.ReshardError, match="does not fit a 64-bit"):
        Layout((1 << 70,), F32, Mesh([0]), [Replicate()])
    with pytest.raises(rx.ReshardError, match="does not fit a 32-bit"):
        Mesh([0, 1 << 40])
    with pytest.raises(rx.ReshardError, match="Shard stride"):
        Layout((8,), F32, Mesh([0]), [Shard(0, stride=1 << 64)])
