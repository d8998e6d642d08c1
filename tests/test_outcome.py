"""One answer on every rank (DESIGN section 2), on CPU/gloo with 4 processes: an execute
returns on every rank only if every rank's part landed, else every rank raises one error
naming the failed ranks and why, soon after the first rank failed; plan.version is the
same everywhere; the group works for the next refit. Also where some ranks are "on other
hosts" (the outcome's recursive doubling over gloo, the store's alarms)."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _cases import bits_equal
from _dist import run_ranks

import reshard_ext as rx
from reshard_ext import _C, Layout, Mesh, Replicate, Shard

F32 = torch.float32
WORLD = 4
LONG = 60.0  # an execute's timeout where failing fast must not wait for it
FAST = 5.0  # the generous bound on how long after the first failure every rank has raised


def _g(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _tp2_tp4(rank: int, world: int, seed: int = 0, options=None, group=None):
    """TP2 x DP2 -> TP4 of one (32, 8) tensor: ranks 0 and 3 never talk to each other."""
    shape = (32, 8)
    src_l = Layout(shape, F32, Mesh([[0, 1], [2, 3]]), [Replicate(), Shard(0)])
    dst_l = Layout(shape, F32, Mesh([0, 1, 2, 3]), [Shard(0)])
    g = _g(shape, seed)
    dst = torch.zeros(dst_l.local_shape(rank))
    p = rx.plan({"w": (src_l.local_part(g, rank), src_l)}, {"w": (dst, dst_l)}, options=options, group=group)
    return p, dst, dst_l.local_part(g, rank)


def _try(fn, *args, **kwargs):
    t0 = time.monotonic()
    try:
        fn(*args, **kwargs)
        return None, time.monotonic() - t0
    except rx.ReshardError as e:
        return str(e), time.monotonic() - t0


def _tp2_tp4_between_hosts(rank: int, world: int, seed: int):
    """_tp2_tp4 over a group of its own whose channel has no mailboxes: headers, data and the
    outcome go over gloo, and alarms through the store, as between hosts."""
    from reshard_ext import options

    os.environ["RESHARD_EXT_HOST_MAILBOX"] = "0"
    options.reload_environment()
    try:
        return _tp2_tp4(rank, world, seed=seed, group=dist.new_group(list(range(world))))
    finally:
        os.environ.pop("RESHARD_EXT_HOST_MAILBOX", None)
        options.reload_environment()


def _case(rank: int, world: int, case: str, far: bool):
    p, out, want = _tp2_tp4_between_hosts(rank, world, 1) if far else _tp2_tp4(rank, world, seed=1)
    rx.execute(p, version=0)  # a connected group to start from
    out.zero_()
    # between hosts a stopped execute's gloo messages stay posted until its deadline, which the
    # next execute waits for: a shorter one here
    kwargs: dict = {"version": 1, "timeout": 12.0 if far else LONG}
    if case == "version":
        kwargs["version"] = 2 if rank == 2 else 1
    elif case == "verify":
        kwargs["verify"] = rank != 1
    elif case == "storage" and rank == 0:
        p._entries["src"]["w"][0].data = torch.zeros(8, 8)  # the source replaced in its module
    elif case == "bad_argument" and rank == 3:
        kwargs["verify"] = "no"
    elif case == "internal" and rank == 2:
        _C.ExecTables.run_pack_cpu = _broken  # an internal error on this rank alone, after its headers
    elif case == "abort" and rank == 1:
        threading.Timer(0.3, p.abort).start()
    if case == "abort" and rank != 1:
        time.sleep(1.0)  # the others come late: rank 1 has aborted and left
    try:
        error, took = _try(rx.execute, p, **kwargs)
    finally:
        _C.ExecTables.run_pack_cpu = _PACK
    version = p.version
    if case == "storage":
        p.rebind(src={"w": (_tp2_tp4_src(rank), p._layouts["src"]["w"])})
    out.zero_()
    again = _try(rx.execute, p, version=7, timeout=LONG)[0]
    return error, took, version, again, p.version, bits_equal(out, want)


_PACK = _C.ExecTables.run_pack_cpu


def _broken(tables, b: int) -> None:
    raise RuntimeError("a pack that breaks")


def _tp2_tp4_src(rank: int) -> torch.Tensor:
    src_l = Layout((32, 8), F32, Mesh([[0, 1], [2, 3]]), [Replicate(), Shard(0)])
    return src_l.local_part(_g((32, 8), 1), rank)


# what every rank's message must say, per case
NAMES = {
    "version": ["different versions", "2 on rank"],
    "verify": ["different verify=", "False on rank"],
    "storage": ["rank 0: bound tensors were replaced or resized", "src tensor 'w'"],
    "bad_argument": ["rank 3: rx.execute: verify must be True or False, got 'no'"],
    "internal": ["rank 2: internal error: RuntimeError: a pack that breaks"],
    "abort": ["rank 1: rx.execute was aborted (plan.abort())"],
}


@pytest.mark.parametrize("far", [False, True], ids=["one_host", "hosts"])
@pytest.mark.parametrize("case", list(NAMES))
def test_a_failure_anywhere_raises_on_every_rank_soon_naming_it(case: str, far: bool) -> None:
    results = run_ranks(WORLD, _case, case, far)
    messages = set()
    for rank, (error, took, version, again, last, ok) in enumerate(results):
        assert error is not None, (rank, case)
        for words in NAMES[case]:
            assert words in error, (rank, words, error)
        assert error.count("\n  ") <= 6 and "reshard_ext/channel" not in error and "Verdict" not in error, error
        assert took < FAST + (1.0 if case == "abort" else 0.0), (rank, took, error)
        assert version is None, (rank, version)  # equal on every rank: None after a failure
        assert again is None and last == 7 and ok, (rank, again)  # the group works on
        if not (case == "abort" and rank == 1):
            messages.add(error.split("\n", 1)[1])
    assert len(messages) == 1, messages  # one answer, alike on every rank that took part


def _skips(rank: int, world: int, far: bool):
    p, out, want = _tp2_tp4_between_hosts(rank, world, 2) if far else _tp2_tp4(rank, world, seed=2)
    rx.execute(p)
    store = dist.distributed_c10d._get_default_store()
    base = store.add("skip_done", 0)
    error, took = None, 0.0
    if rank != 1:  # rank 1 never calls this execute: it waits until the others gave up on it
        error, took = _try(rx.execute, p, timeout=2.0)
        store.add("skip_done", 1)
    _until(store, "skip_done", base + world - 1)
    # rank 1 made one call fewer: this one meets (at the others' attempt count, exchange_headers)
    return _then_retry(p, out, want, error, took)


def _until(store, key: str, count: int) -> None:
    """Waits until the store's counter `key` reaches `count` (the ranks pace each other)."""
    while store.add(key, 0) < count:
        time.sleep(0.01)


def _then_retry(p, out, want, error, took):
    """What _skips and _stalls return: the failed execute's answer, then a retry's."""
    version = p.version
    again = _try(rx.execute, p, version=3, timeout=LONG)[0]
    return error, took, version, again, p.version, bits_equal(out, want)


@pytest.mark.parametrize("far", [False, True], ids=["one_host", "hosts"])
def test_a_rank_that_never_calls_is_named_at_the_timeout(far: bool) -> None:
    results = run_ranks(WORLD, _skips, far)
    for rank, (error, took, version, again, last, ok) in enumerate(results):
        if rank != 1:
            assert error is not None and "rank 1" in error and "within 2 s" in error, (rank, error)
            assert "rank 0 sent" not in error and "rank 2 sent" not in error and "/default_pg" not in error, error
            assert took < 2.0 + FAST, took
        assert version is None and again is None and last == 3 and ok, (rank, again)


def _stalls(rank: int, world: int, at_once: bool, far: bool = False):
    """Rank 0 calls the execute on time but its part stalls past the timeout: the others
    give up on it and leave; it reaches the end alone, its watch not looking (as where a
    loaded machine ran it too late: PeerWatch.last_look must find their alarms), so that it
    goes on to move its data late. On one host the others come 0.5 s after it and its pack
    ends as they have left, past its own deadline; between hosts its pack sleeps 4 s of the
    2 s timeout. Then every rank executes again: once rank 0 has its answer, or (at_once) as
    soon as each has its own, the others' retry beginning while rank 0 is still in the
    failed call. Every rank's
    source changes between the two calls (a trainer step): rank 0's late data of the failed
    call must land nowhere in the retry. far: no rank reaches another through shared memory,
    as between hosts (a group of its own whose channel has no mailboxes: headers, data and
    the outcome over gloo)."""
    p, out, want = _tp2_tp4_between_hosts(rank, world, 4) if far else _tp2_tp4(rank, world, seed=4)
    rx.execute(p)
    store = dist.distributed_c10d._get_default_store()
    base, left = store.add("stall_done", 0), store.add("stall_left", 0)
    ready = store.add("stall_ready", 1)  # every rank has read the counts before any adds to them
    _until(store, "stall_ready", (ready - 1) // world * world + world)
    if rank == 0:
        real = _C.ExecTables.run_pack_cpu

        def slow(*args, _real=real):
            _C.ExecTables.run_pack_cpu = _real
            if far:
                time.sleep(4.0)
            else:
                _until(store, "stall_left", left + world - 1)
            return _real(*args)

        _C.ExecTables.run_pack_cpu = slow
    elif not far:
        time.sleep(0.5)
    watch = p.transport.channel.watch
    if rank == 0:
        watch.start = lambda session, stop: None  # for this call only (the instance's own, deleted below)
    error, took = _try(rx.execute, p, timeout=2.0)
    vars(watch).pop("start", None)
    store.add("stall_left", 1)
    if rank == 0:
        store.add("stall_done", 1)
    p._entries["src"]["w"][0].add_(1.0)
    if not at_once:  # the next execute once rank 0 has its answer
        _until(store, "stall_done", base + 1)
    return _then_retry(p, out, want + 1.0, error, took)


def _one_cause(results) -> str:
    """The stall's answers: one on the ranks that left on time, and the same cause first on
    rank 0 (which says besides that it came late, and that it cannot tell whether the parts
    of ranks 2 and 3, which it never heard from, landed). Returns that cause."""
    answers = {results[r][0] for r in range(1, WORLD)}
    assert len(answers) == 1, answers
    assert "not completed on ranks [0, 1] (" in results[1][0] and "completed on ranks [2, 3]" in results[1][0]
    late = results[0][0]
    cause = results[1][0].split("\n")[1].strip()
    assert late.split("\n")[1].strip() == cause, (late, cause)
    assert "not completed on ranks [0, 1] (" in late and "ranks [2, 3] not known to this rank" in late, late
    return cause


@pytest.mark.parametrize("at_once", [False, True], ids=["retry_after", "retry_at_once"])
def test_a_rank_that_stalls_past_the_timeout_hears_why_the_others_left(at_once: bool) -> None:
    """The stalled rank raises with the cause the others raised (rank 1's alarm: rank 0 sent
    it nothing in time) and says that it came late, instead of blaming the ranks that left.
    A retry that begins while it is still in the failed call waits for it to leave that call,
    so that its data does not land in the retry of the others while its own call fails: the
    retry lands on every rank."""
    results = run_ranks(WORLD, _stalls, at_once)
    for rank, (error, took, version, again, last, ok) in enumerate(results):
        assert error is not None and "rank 0" in error, (rank, error)
        assert version is None and again is None and last == 3 and ok, (rank, version, again)
        if rank:
            assert took < 2.0 + FAST, (rank, took)
    late = results[0][0]
    assert "rank 0 sent no execute header within 2 s" in _one_cause(results), late
    assert "did not reach the end" not in late and "past the 2 s timeout" in late, late


@pytest.mark.parametrize("at_once", [False, True], ids=["retry_after", "retry_at_once"])
def test_a_rank_that_stalls_on_another_host_is_named_in_words(at_once: bool) -> None:
    """Between hosts the stall is seen by gloo; its errors are said in words (not gloo's source
    lines and guesses), alike on every rank: rank 2, whose union from ranks 0 and 1 never
    comes (its pair with rank 0 fails), reads rank 1's alarm, which names rank 0 as the rank
    it gave up on (Alarm.gave_up); rank 0 reads it too, also where rank 1 took it back as its
    retry began. A retry lands on every rank, also one that begins while rank 0 is still in
    the failed call: the messages of each attempt carry its count, so rank 0's late outcome
    never answers for the others' retry (outcome._talk_to)."""
    results = run_ranks(WORLD, _stalls, at_once, True)
    for rank, (error, _took, version, again, last, ok) in enumerate(results):
        assert error is not None and "rank 0" in error, (rank, error)
        assert "gloo" not in error and ".cc:" not in error, (rank, error)
        assert version is None and again is None and last == 3 and ok, (rank, version, again)
    assert _one_cause(results) == "rank 1: the data exchange with rank 0 failed (it sent nothing within 2 s)"


def _killed(rank: int, world: int, far_ok: bool):
    p, out, want = _tp2_tp4(rank, world, seed=3)
    rx.execute(p)
    if rank == 2:  # dies inside the execute, after its headers, before its data
        _C.ExecTables.run_pack_cpu = lambda tables, b: time.sleep(60)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    return _try(rx.execute, p, timeout=LONG)


def test_a_killed_rank_is_named_within_seconds() -> None:
    results = run_ranks(WORLD, _killed, True, dies=(2,))
    for rank, result in enumerate(results):
        if rank == 2:
            continue
        error, took = result
        assert error is not None and "rank 2: its process exited during the execute" in error, (rank, error)
        assert took < 0.5 + FAST, (rank, took)


# --- messages ----------------------------------------------------------------------------------

def test_layout_mistakes_raise_where_they_are_made() -> None:
    with pytest.raises(rx.ReshardError, match="dtype must be a torch.dtype such as torch.bfloat16, got the string"):
        Layout((4, 4), "bfloat16", Mesh([0, 1]), [Shard(0)])
    with pytest.raises(rx.ReshardError, match=r"Shard\(2\) of a 2-d tensor \(dims are -2 to 1\)"):
        Layout((4, 4), F32, Mesh([0, 1]), [Shard(2)])
    Layout((4, 4), F32, Mesh([0, 1]), [Shard(-2)])


def test_gloo_failures_are_said_in_words() -> None:
    from reshard_ext.transports.channel import gloo_words

    closed = RuntimeError("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                          "[127.0.0.1]:32643. This is typically caused by a remote worker crashing. GLHF!")
    assert gloo_words(closed, 2.0) == ("it closed the connection (its process exited, or it had already given up "
                                       "on this execute)")
    recv = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1999ms for recv operation")
    send = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:136] Timed out waiting 1999ms for send operation")
    assert gloo_words(recv, 2.0) == "it sent nothing within 2 s"
    assert gloo_words(send, 2.5) == "it did not take this rank's message within 2.5 s"
    closed = RuntimeError("Application timeout caused pair closure")
    assert gloo_words(closed, 1.0) == "the connection to it had closed after an earlier wait on it timed out"
    other = RuntimeError("[gloo/x.cc:1] Something odd. This is typically caused by a remote worker crashing.")
    assert gloo_words(other, 1.0) == "Something odd"


def _summary(rank: int, world: int):
    p, _, _ = _tp2_tp4(rank, world)
    rx.execute(p, version=4)
    return repr(p)


def test_plan_repr_is_its_summary() -> None:
    for rank, text in enumerate(run_ranks(WORLD, _summary)):
        assert text.startswith(f"<reshard_ext.Plan on rank {rank}: ") and "backend 'cpu'" in text, text
        for words in ("sends", "receives", "with ranks", "batch", "staging", "version 4"):
            assert words in text, (words, text)


# --- what an adversarial probe found (issue #37, item 7) ---------------------------------------

def _bad_env(rank: int, world: int, name: str, value: str):
    from reshard_ext import options

    if rank == 1:  # one rank only: it must not be the only one to raise while the others wait
        os.environ[name] = value
        options.reload_environment()
    try:
        error, took = _try(_tp2_tp4, rank, world)
    finally:
        os.environ.pop(name, None)
        options.reload_environment()
    p, out, want = _tp2_tp4(rank, world)
    rx.execute(p)
    return error, took, bits_equal(out, want)


@pytest.mark.parametrize("name,value", [("RESHARD_EXT_TIMEOUT", "abc"), ("RESHARD_EXT_CPU_DIRECT_BYTES", "-3")])
def test_a_bad_variable_on_one_rank_raises_on_every_rank_in_plan(name: str, value: str) -> None:
    for rank, (error, took, ok) in enumerate(run_ranks(WORLD, _bad_env, name, value)):
        assert error is not None and f"rank 1: environment variable {name}={value!r} is invalid" in error, error
        assert took < FAST and ok, (rank, took)


def _huge_timeouts(rank: int, world: int):
    p, out, want = _tp2_tp4(rank, world, seed=4)
    rx.execute(p, timeout=1e18)
    q, out_q, want_q = _tp2_tp4(rank, world, seed=5, options=rx.Options(timeout=1e308))
    rx.execute(q)
    rx.execute(q, verify=True)
    return bits_equal(out, want) and bits_equal(out_q, want_q)


def test_huge_timeouts_mean_never() -> None:
    assert all(run_ranks(WORLD, _huge_timeouts))


_NANS = [0x7FC00000, 0xFFC00000, 0x7FC00001, 0xFFFFFFFF, 0x7F800001, 0xFF800001, 0x7FA00000, 0x7FFFFFFF]


def _nan_refit(rank: int, world: int, dtype: torch.dtype):
    bits = torch.tensor(_NANS * 4, dtype=torch.int64).to(torch.int32)
    values = torch.cat([bits.view(F32), torch.tensor([1.5, -0.0, float("inf"), 3e38] * 8)]).view(16, 4)
    src_l = Layout(values.shape, F32, Mesh([0, 1]), [Shard(0)])
    dst_l = Layout(values.shape, dtype, Mesh([2, 3]), [Shard(1)])
    src = {"w": (src_l.local_part(values, rank), src_l)} if rank in (0, 1) else {}
    out = torch.zeros(dst_l.local_shape(rank), dtype=dtype) if rank in (2, 3) else None
    p = rx.plan(src, {"w": (out, dst_l)} if out is not None else {})
    rx.execute(p, verify=True)
    if out is None:
        return True
    want = dst_l.local_part(values, rank).to(dtype)  # Tensor.to on the same device: the refit's promise
    return torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nan_payloads_cast_as_tensor_to(dtype: torch.dtype) -> None:
    assert all(run_ranks(WORLD, _nan_refit, dtype))


def _two_groups(rank: int, world: int):
    groups = [dist.new_group(list(range(world))), dist.new_group(list(range(world)))]
    plans = [_tp2_tp4(rank, world, seed=10 + i, group=g) for i, g in enumerate(groups)]
    errors: list = []

    def refits(p) -> None:
        for _ in range(20):
            errors.append(_try(rx.execute, p)[0])

    threads = [threading.Thread(target=refits, args=(p,)) for p, _, _ in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [e for e in errors if e], all(bits_equal(out, want) for _, out, want in plans)


def test_plans_on_two_groups_of_the_same_ranks_run_at_once_from_two_threads() -> None:
    for errors, ok in run_ranks(WORLD, _two_groups):
        assert errors == [] and ok, errors


def _after_destroy(rank: int, world: int):
    p, _, _ = _tp2_tp4(rank, world)
    rx.execute(p)
    port = int(os.environ.get("RX_REINIT_PORT", "0"))
    dist.destroy_process_group()
    try:
        return _try(rx.verify, p)[0], _try(rx.execute, p)[0]
    finally:
        import datetime

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))


def test_a_plan_of_a_destroyed_group_raises_in_words() -> None:
    from _dist import close_pool, free_port

    os.environ["RX_REINIT_PORT"] = str(free_port())  # read by the spawned ranks: set before the pool starts
    close_pool(WORLD)
    try:
        for verify_error, execute_error in run_ranks(WORLD, _after_destroy):
            for e in (verify_error, execute_error):
                assert e is not None and "process group was destroyed" in e, e
    finally:
        close_pool(WORLD)
        os.environ.pop("RX_REINIT_PORT", None)


def _late_after_exit(rank: int, world: int):
    p, _, _ = _tp2_tp4(rank, world, seed=6)
    rx.execute(p)
    if rank == 0:  # a short timeout, raises, and its process exits (it hosts the group's store, too)
        _try(rx.execute, p, timeout=1.0)
        os._exit(0)
    time.sleep(3.0)
    return _try(rx.execute, p, timeout=LONG)


def test_a_peer_that_exited_is_named_with_what_happened() -> None:
    for rank, result in enumerate(run_ranks(WORLD, _late_after_exit, dies=(0,))):
        if rank == 0:
            continue
        error, took = result
        assert error is not None and "rank 0" in error and "exited" in error, error
        assert "never made a plan" not in error and "5 s" not in error and took < FAST, (took, error)


def _relay_killed(rank: int, world: int):
    shape = (64, 16)
    src_l = Layout(shape, F32, Mesh([0]), [Replicate()])
    dst_l = Layout(shape, F32, Mesh([1, 2, 3]), [Replicate()])
    g = _g(shape, 7)
    src = {"w": (g.clone(), src_l)} if rank == 0 else {}
    dst = {"w": (torch.zeros(shape), dst_l)} if rank else {}
    p = rx.plan(src, dst, options=rx.Options(relay=True))
    assert p.relayed_tensors == 1
    rx.execute(p)
    if rank == 3:  # a replica dies in the first stage, after its headers
        _C.ExecTables.run_unpack_cpu = lambda tables, b: time.sleep(60)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    return _try(rx.execute, p, timeout=LONG)


def test_a_relay_with_a_killed_replica_raises_once_soon() -> None:
    for rank, result in enumerate(run_ranks(WORLD, _relay_killed, dies=(3,))):
        if rank == 3:
            continue
        error, took = result
        assert error is not None and "rank 3: its process exited" in error, (rank, error)
        assert took < 0.5 + FAST and error.count("rank 3: its process exited") == 1, (rank, took, error)
