"""Executes that every rank can trust, on CPU/gloo: ranks agree on the plan they run
(headers), one execute per group at a time, bound tensors that changed under the plan,
versions, timeouts, abort, dead and stalled peers, and no memory growth."""
from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _cases import bits_equal
from _dist import close_pool, run_ranks

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Shard, watch

F32 = torch.float32


def _g(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _pair_plan(rank: int, world: int, rows: int = 8, seed: int = 0, cols: int = 4, device: str = "cpu", options=None):
    """A plan in which every rank sends to and receives from every other one (rows to columns)."""
    shape = (rows * world, cols * world)
    src_l = Layout(shape, F32, Mesh(list(range(world))), [Shard(0)])
    dst_l = Layout(shape, F32, Mesh(list(range(world))), [Shard(1)])
    g = _g(shape, seed)
    dst = torch.zeros(dst_l.local_shape(rank), device=device)
    p = rx.plan({"w": (src_l.local_part(g, rank).to(device), src_l)}, {"w": (dst, dst_l)}, options=options)
    return p, dst, dst_l.local_part(g, rank)


def _same(out: torch.Tensor, want: torch.Tensor) -> bool:
    if out.is_cuda:
        torch.cuda.synchronize()
    return bits_equal(out.cpu(), want)


def _usable(world: int) -> bool:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item() == world


def _try(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
        return None
    except rx.ReshardError as e:
        return str(e)


# --- every rank runs the same plan -------------------------------------------------------

def _two_orders(rank: int, world: int, same_sizes: bool):
    a, out_a, want_a = _pair_plan(rank, world, seed=1)
    b, out_b, want_b = _pair_plan(rank, world, rows=8 if same_sizes else 24, seed=2)
    first, second = (a, b) if rank == 0 else (b, a)
    errors = [_try(rx.execute, first), _try(rx.execute, second)]
    untouched = not out_a.any() and not out_b.any()
    rx.execute(a)  # in the same order now: both work
    rx.execute(b)
    return errors, untouched, bits_equal(out_a, want_a) and bits_equal(out_b, want_b), _usable(world)


@pytest.mark.parametrize("same_sizes", [True, False])
def test_plans_executed_in_different_orders_raise_on_every_rank(same_sizes):
    for rank, (errors, untouched, ok, usable) in enumerate(run_ranks(2, _two_orders, same_sizes)):
        for e in errors:
            assert e is not None and "ranks 0 and 1 ran different plans" in e, (rank, e)
        assert untouched and ok and usable


def _mismatch_three(rank: int, world: int):
    """Ranks 0 and 1 execute plan a; rank 2 executes plan b. Every rank talks to every
    other one in both plans."""
    a, out_a, want_a = _pair_plan(rank, world, seed=1)
    b, _, _ = _pair_plan(rank, world, seed=2)
    error = _try(rx.execute, b if rank == 2 else a)
    rx.execute(a)
    return error, bits_equal(out_a, want_a)


def test_a_rank_on_another_plan_makes_every_rank_it_talks_to_raise():
    results = run_ranks(3, _mismatch_three)
    for rank, (error, ok) in enumerate(results):  # the same answer on every rank, naming the pairs
        assert error is not None, rank
        assert "ranks 0 and 2 ran different plans" in error and "ranks 1 and 2 ran different plans" in error
        assert "ranks 0 and 1" not in error
        assert ok


def _versions(rank: int, world: int):
    p, out, want = _pair_plan(rank, world)
    before = p.version
    rx.execute(p, version=5)
    after = p.version
    error = _try(rx.execute, p, version=6 if rank == 0 else 7)
    after_mismatch = p.version
    rx.execute(p, version=8)
    return before, after, error, after_mismatch, p.version, bits_equal(out, want)


def test_version_is_what_fully_landed():
    for _rank, (before, after, error, after_mismatch, last, ok) in enumerate(run_ranks(2, _versions)):
        assert before is None and after == 5 and last == 8 and ok
        assert error is not None and "version" in error, error
        assert after_mismatch is None  # a failed execute leaves no version


def _verify_on_one_rank(rank: int, world: int):
    """Rank 0 executes with verify=True, rank 1 without: the check that follows is
    collective, so both ranks must raise at the headers, before data moves."""
    p, out, want = _pair_plan(rank, world)
    t0 = time.monotonic()
    error = _try(rx.execute, p, verify=rank == 0)
    took = time.monotonic() - t0
    untouched = not out.any()
    rx.execute(p, verify=True)
    return error, took, untouched, bits_equal(out, want)


def test_verify_on_one_rank_only_raises_on_both_at_once():
    for rank, (error, took, untouched, ok) in enumerate(run_ranks(2, _verify_on_one_rank)):
        want = "passed different verify= to rx.execute: False on ranks [1], True on ranks [0]"
        assert error is not None and want in error, (rank, error)
        assert took < 10 and untouched and ok, (rank, took, untouched, ok)


def _bad_version_one_rank(rank: int, world: int):
    p, out, want = _pair_plan(rank, world)
    error = _try(rx.execute, p, version="v1" if rank == 1 else 1)
    rx.execute(p)
    return error, bits_equal(out, want)


def test_bad_execute_argument_on_one_rank_raises_on_every_rank():
    results = run_ranks(2, _bad_version_one_rank)
    for error, _ in results:  # one message, on every rank
        assert "rank 1: rx.execute: version must be None or a 64-bit integer, got 'v1'" in error, error
    assert results[0][0] == results[1][0]
    assert all(ok for _, ok in results)


# --- one execute per group at a time ---------------------------------------------------------

def _threads(rank: int, world: int):
    p, out, want = _pair_plan(rank, world, seed=1)
    q, _, _ = _pair_plan(rank, world, seed=2)
    if rank == 1:
        time.sleep(1.5)  # rank 0's first execute waits for this rank meanwhile
        rx.execute(p)
        return None, bits_equal(out, want)
    errors: list = []
    t = threading.Thread(target=lambda: errors.append(_try(rx.execute, p)))
    t.start()
    time.sleep(0.5)
    second = _try(rx.execute, q)  # another thread, same group, while p is in flight
    t.join()
    return (errors[0], second), bits_equal(out, want)


def test_concurrent_executes_on_one_group_are_refused():
    (first, second), ok0 = run_ranks(2, _threads)[0]
    assert first is None and ok0
    assert second is not None and "concurrent executes on one group are refused" in second


# --- bound tensors replaced or resized -------------------------------------------------------

@contextlib.contextmanager
def _storage_check(fast: bool):
    """The bound-storage check through torch's C data_ptr reader (fast) or Tensor.data_ptr."""
    saved = watch.DATA_PTR_FN
    if not fast:
        watch.DATA_PTR_FN = 0
    elif not saved:
        pytest.skip("this torch exports no C data_ptr reader")
    try:
        yield
    finally:
        watch.DATA_PTR_FN = saved


def _replaced(rank: int, world: int, how: str, fast: bool):
    shape = (8 * world, 4)
    src_l = Layout(shape, F32, Mesh(list(range(world))), [Shard(0)])
    dst_l = Layout(shape, F32, Mesh(list(range(world))[::-1]), [Shard(0)])
    g = _g(shape, 3)
    param = torch.nn.Parameter(src_l.local_part(g, rank).clone(), requires_grad=False)
    dst = torch.zeros(dst_l.local_shape(rank))
    with _storage_check(fast):
        p = rx.plan({"w": (param, src_l)}, {"w": (dst, dst_l)})
    used_fast = p._watch.fast is not None
    if rank == 1:
        if how == "data":
            param.data = src_l.local_part(g, rank) * 2
        elif how == "grow":
            param.resize_(64, 64)
        elif how == "free_storage":  # as FSDP frees unsharded parameters
            param.untyped_storage().resize_(0)
        elif how == "shrink":  # the storage keeps its memory: nothing to detect
            param.resize_(2, 2)
    error = _try(rx.execute, p)
    untouched = not dst.any()
    if rank == 1:
        param = torch.nn.Parameter(src_l.local_part(g, rank).clone(), requires_grad=False)
    p.rebind(src={"w": (param, src_l)})
    rx.execute(p)
    return error, untouched, bits_equal(dst, dst_l.local_part(g, rank)), used_fast


@pytest.mark.parametrize("fast", [True, False], ids=["c_data_ptr", "tensor_data_ptr"])
@pytest.mark.parametrize("how", ["data", "grow", "free_storage"])
def test_bound_tensor_replaced_or_resized_raises_before_data_moves(how, fast):
    if fast and not watch.DATA_PTR_FN:
        pytest.skip("this torch exports no C data_ptr reader")
    results = run_ranks(2, _replaced, how, fast)
    for error, *_ in results:  # one message, on every rank, naming the rank and the tensor
        assert "rank 1: bound tensors were replaced or resized" in error and "src tensor 'w'" in error, error
    for _error, untouched, ok, used_fast in results:
        assert untouched and ok and used_fast == fast


@pytest.mark.parametrize("fast", [True, False], ids=["c_data_ptr", "tensor_data_ptr"])
def test_bound_tensor_shrunk_in_its_storage_raises(fast):
    """A resize_ that keeps the storage's memory still changes the tensor: the plan would
    read (or, for a destination, write) past it."""
    if fast and not watch.RAW_LAYOUT:
        pytest.skip("this torch's tensor layout is not read directly")
    for error, untouched, ok, _ in run_ranks(2, _replaced, "shrink", fast):
        assert "rank 1: bound tensors were replaced or resized" in error and "128 -> 16 bytes" in error, error
        assert untouched and ok


@pytest.mark.parametrize("fast", [True, False], ids=["c_data_ptr", "tensor_data_ptr"])
def test_storage_check_unit(fast):
    """Watch alone (no process group): which path reads the pointers, and what each detects."""
    with _storage_check(fast):
        tensors = [torch.zeros(4, 4), torch.nn.Parameter(torch.zeros(8), requires_grad=False), torch.zeros(6)[2:]]
        w = watch.Watch({"src": {f"s{i}": (t, None) for i, t in enumerate(tensors)}, "dst": {}})
    assert (w.fast is not None and len(w.fast) == 3 and not w.slow) == fast
    assert w.changed(0) == ""
    tensors[2].data = torch.zeros(6)[1:]  # a view of a new storage: data_ptr moves
    tensors[1].untyped_storage().resize_(0)
    assert "src tensor 's1'" in w.changed(0) and "src tensor 's2'" in w.changed(0)
    assert "src tensor 's0'" not in w.changed(0)


@pytest.mark.parametrize("fast", [True, False], ids=["c_data_ptr", "tensor_data_ptr"])
def test_storage_freed_and_reused_at_the_same_address_is_detected(fast):
    """data_ptr alone misses a storage freed and replaced by a smaller one at the same
    address (the kernels would write past it): the freed signal catches it."""
    for n in (1000, 100000, 4096, 250000, 3000, 50000):
        with _storage_check(fast):
            t = torch.nn.Parameter(torch.zeros(n), requires_grad=False)
            w = watch.Watch({"src": {}, "dst": {"w": (t, None)}})
        ptr = t.data_ptr()
        t.data = torch.empty(0)
        t.data = torch.empty(n // 2)
        if t.data_ptr() == ptr:
            break
    else:
        pytest.skip("the allocator never reused the freed address")
    assert "dst tensor 'w'" in w.changed(0) and "its storage freed" in w.changed(0)


def _rebind_meta(rank: int, world: int):
    p, out, want = _pair_plan(rank, world)
    errors = [_try(p.rebind, dst={"w": (torch.empty(out.shape, device="meta"), p._layouts["dst"]["w"])}),
              _try(p.rebind, dst={"w": (torch.zeros(1, 2, 3)[..., 0], p._layouts["dst"]["w"])}),
              _try(p.rebind, dst=[out])]
    rx.execute(p)  # the plan kept its tensors
    return errors, bits_equal(out, want)


def test_rebind_to_unusable_tensors_raises_and_keeps_the_plan():
    for errors, ok in run_ranks(2, _rebind_meta):
        assert "on device meta" in errors[0]
        assert "local shape" in errors[1]
        assert "expected a dict" in errors[2]
        assert ok


# --- timeouts, abort, dead and stalled peers ------------------------------------------------

def _timeout_per_call(rank: int, world: int, device: str = "cpu"):
    p, out, want = _pair_plan(rank, world, device=device)
    store = dist.distributed_c10d._get_default_store()
    base = store.add("timed_out", 0)  # a counter: the pool's processes may run this test again
    dist.barrier()
    if rank == 0:
        t0 = time.monotonic()
        error = _try(rx.execute, p, timeout=1.5)
        elapsed = time.monotonic() - t0
        store.add("timed_out", 1)
    else:  # skips that execute: waits until rank 0 gave up on it (a fixed sleep raced a loaded machine)
        while store.add("timed_out", 0) == base:
            time.sleep(0.01)
        error, elapsed = None, 0.0
    rx.execute(p, version=2)
    return error, elapsed, p.version, _same(out, want)


def test_execute_timeout_overrides_the_default():
    # The environment default (600 s) would hang the test; timeout=1.5 raises in about that.
    results = run_ranks(2, _timeout_per_call)
    error, elapsed, _, _ = results[0]
    assert error is not None and "rank 1 sent no execute header within 1.5 s" in error, error
    assert 1.0 < elapsed < 10
    for _, _, version, ok in results:
        assert version == 2 and ok


def _abort(rank: int, world: int):
    p, out, want = _pair_plan(rank, world, seed=4)
    t0 = time.monotonic()
    if rank == 0:
        threading.Timer(0.5, p.abort).start()  # from another thread, while rank 1 is away
        error = _try(rx.execute, p, timeout=3)
    else:
        time.sleep(1.0)
        error = _try(rx.execute, p, timeout=3)  # its peer aborted: raises within the timeout
    elapsed = time.monotonic() - t0
    version = p.version
    rx.execute(p, version=1)  # the same plan works again
    return error, elapsed, version, p.version, bits_equal(out, want)


def test_abort_stops_this_rank_promptly_and_the_plan_runs_again():
    results = run_ranks(2, _abort)
    error, elapsed, version, _, _ = results[0]
    assert error is not None and "aborted" in error and elapsed < 2.0, (error, elapsed)
    error, elapsed, _, _, _ = results[1]
    assert error is not None and elapsed < 8, (error, elapsed)
    for _, _, version, last, ok in results:
        assert version is None and last == 1 and ok


def test_abort_without_an_execute_is_a_no_op():
    assert all(run_ranks(2, _abort_idle))


def _abort_idle(rank: int, world: int):
    p, out, want = _pair_plan(rank, world)
    p.abort()
    rx.execute(p)
    return bits_equal(out, want)


def _dies(rank: int, world: int):
    p, _, _ = _pair_plan(rank, world)
    rx.execute(p)
    if rank == 1:
        threading.Timer(0.5, os._exit, (0,)).start()  # dies after answering, before the next execute
        return None, 0.0
    time.sleep(1.5)
    t0 = time.monotonic()
    error = _try(rx.execute, p, timeout=3)
    return error, time.monotonic() - t0


def test_peer_that_died_before_execute_raises_reshard_error():
    error, elapsed = run_ranks(2, _dies)[0]
    close_pool(2)
    assert error is not None and "rank 1" in error, error
    assert elapsed < 10


def _stall_in_plan(rank: int, world: int):
    if rank == 1:
        time.sleep(4)
    t0 = time.monotonic()
    error = _try(_pair_plan, rank, world, options=rx.Options(timeout=2.0))
    return error, time.monotonic() - t0


def test_rank_stalling_in_plan_raises_after_the_reshard_timeout():
    results = run_ranks(2, _stall_in_plan)
    close_pool(2)  # a collective is left outstanding on the caller's group
    error, elapsed = results[0]
    assert error is not None and "within 2 s" in error and elapsed < 10, (error, elapsed)
    assert results[1][0] is not None


# --- no growth -------------------------------------------------------------------------------

def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _churn(rank: int, world: int, n: int):
    import gc

    p, out, want = _pair_plan(rank, world, rows=64, seed=5)
    for _ in range(50):  # warm up: allocator pools, channel connections
        rx.execute(p)
        _pair_plan(rank, world, rows=16, seed=6)
    gc.collect()
    base = _rss_mb()
    ok = True
    for i in range(n):
        out.zero_()
        rx.execute(p, version=i)
        ok = ok and bits_equal(out, want)
    mid = _rss_mb()
    for _ in range(n):
        q, o, w = _pair_plan(rank, world, rows=16, seed=6)
        rx.execute(q)
        ok = ok and bits_equal(o, w)
        del q
    gc.collect()
    return base, mid, _rss_mb(), ok


def test_thousand_executes_and_plans_do_not_grow_memory():
    for base, mid, end, ok in run_ranks(2, _churn, 1000, timeout=300):
        assert ok
        assert mid - base < 8 and end - base < 16, (base, mid, end)
