"""Bad input: every rank raises ReshardError naming the tensor, before any data moves;
no dst tensor changes, nothing hangs, and the process group is still usable."""
import pytest
import torch
import torch.distributed as dist

import reshard_ext as rx
from _cases import bits_equal
from _dist import run_ranks
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
    elif kind == "rank_outside_group":
        src_l = Layout(shape, F32, Mesh([0, world + 3]), [Shard(0)])
    elif kind == "disagree":
        src_l = Layout(shape, F32, Mesh([0, 1]), [Shard(0)] if rank == 0 else [Shard(1)])
    elif kind == "mesh_rank_passes_nothing":
        pass  # rank 1 drops its piece below
    elif kind == "not_in_mesh":
        extra_src = {name: (torch.randn(4, 4), src_l)} if rank == 2 else {}
    elif kind == "shard_dim_out_of_range":
        src_l = Layout(shape, F32, Mesh([0, 1]), [Shard(-3)])
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
    "unknown_name", "shape_mismatch", "float_int_cast", "strided_not_divisible", "blocks_wrong_sum",
    "rank_outside_group", "disagree", "mesh_rank_passes_nothing", "not_in_mesh", "local_shape", "local_dtype",
    "shard_dim_out_of_range", "fp8_cast", "mesh_beyond_group",
]

# What the message of some kinds must say, beyond naming the tensor.
EXPLAINED = {
    "shard_dim_out_of_range": "Shard(-3) of a 2-d tensor (dims are -2 to 1)",
    "fp8_cast": "conversions exist only among float16, bfloat16, float32 and float64",
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
    p = rx.plan(src, dst, options=rx.Options(timeout=timeout_s))
    try:
        if rank == 1:
            return "skipped"  # never posts its receive: rank 0 must not wait forever
        rx.execute(p)
        return "no error"
    except rx.ReshardError as e:
        return str(e)


def test_peer_that_skips_execute_raises_instead_of_hanging():
    # world 3: its own pool, since the group is left with an unmatched send
    results = run_ranks(3, _skip_execute, 3.0, timeout=120)
    assert results[1] == "skipped"
    assert "did not complete within 3 s" in results[0], results[0]


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
