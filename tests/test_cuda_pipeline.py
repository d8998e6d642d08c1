"""The GPU executor's schedule (csrc/comm/executor.h), checked on any machine: a recording
device and transport log what the executor asks of them, on real plan tables bound to
made-up addresses, so the pipelining (pack k+1 and then the copy slice of k under transfer
k, unpack k only after transfer k), the verify rounds, the degraded mode and the trace
timeline are tested without a GPU, through CudaTransport.run."""
from __future__ import annotations

import re
import threading
from typing import Any

import pytest
import torch
from test_message_cuts import _SPAN, bind_all

from reshard_ext import _C, Layout, Mesh, Replicate, Shard
from reshard_ext.errors import ReshardError
from reshard_ext.transports import cuda as cuda_transport
from reshard_ext.transports.channel import Session, Verdict

MAIN = 1  # the recording device's main stream


class FakeComm:
    timeout = 1.0
    usable = True


def _tables(world: int, batches: int, direct_bytes: int) -> Any:
    """Rank 0's tables of x (4 MiB) and y (1 KiB) gathered from `world` shards onto every
    rank, in `batches` batches (the max_batch_bytes that makes them)."""
    mesh = Mesh(list(range(world)))
    src = {"x": Layout((1 << 20,), torch.float32, mesh, [Shard(0)]),
           "y": Layout((256 * world,), torch.float32, mesh, [Shard(0)])}
    dst = {n: Layout(lay.shape, torch.float32, mesh, [Replicate()]) for n, lay in src.items()}
    for limit in [None] + [(64 - i) << 16 for i in range(60)]:
        tables = bind_all(src, dst, world, direct_bytes, limit)
        if tables is not None and tables[0].num_batches == batches:
            return tables[0]
    raise AssertionError(f"no batch limit makes {batches} batches")


def _transport(tables: Any, rounds: bool = False, max_blocks: int = 0, trace: bool = False,
               sliced: bool = True) -> tuple[cuda_transport.CudaTransport, Any, Any]:
    """A CudaTransport whose executor records; every peer agrees unless a test says otherwise."""
    log = _C.RecordingLog()
    ex = _C.Executor.recording(log)
    transport = _C.RecordingTransport(log, rounds)
    ex.set_transport(transport)
    rank = 0
    recv_bufs = [((rank + 1) << 48) - (j + 1) * _SPAN for j in (2, 3)]  # bind_all's receive staging
    ex.prepare(tables, sliced, max_blocks, [(p, tables.recv_buffer_bytes) for p in recv_bufs])
    t = object.__new__(cuda_transport.CudaTransport)
    t.executor, t.comm, t.p2p, t.trace, t.last_timeline = ex, FakeComm(), None, trace, ""
    t.peers, t.channel, t._digests = list(ex.peers), type("FakeChannel", (), {"rank": 0})(), None
    # The header exchange runs the first pack while headers travel.
    t._agree = lambda tables, session, pack0: (pack0(), (set(t.peers), True))[1]
    return t, log, transport


@pytest.fixture(autouse=True)
def _main_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: type("S", (), {"cuda_stream": MAIN})())
    # where torch has CUDA, executes read the stream through its raw getter: the recording's here
    monkeypatch.setattr(cuda_transport, "_RAW_STREAM", lambda device: MAIN)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)


def _session() -> Session:
    return Session(plan_id=1, seq=1, version=None, status=0, deadline=1e18, timeout=1.0, abort=threading.Event())


def _steps(log: Any) -> list[str]:
    """The log with each post's messages left out."""
    return [re.sub(r" sends .*", "", line) for line in log.lines]


def test_pipeline_order() -> None:
    tables = _tables(2, 3, 0)
    t, log, _ = _transport(tables)
    assert t.executor.num_copy_slices == 3
    t.run(tables, _session())
    assert _steps(log) == [
        "main: pack 0", "side: wait main", "side: post 0", "side: record e1",
        "main: pack 1", "side: wait main", "side: post 1", "side: record e2",  # posted before waiting for 0
        "main: copy 0",  # under transfer 0, after the pack of 1: it never delays transfer 1
        "main: wait e1", "main: unpack 0",
        "main: pack 2", "side: wait main", "side: post 2", "side: record e3",
        "main: copy 1", "main: wait e2", "main: unpack 1",
        "main: copy 2", "main: wait e3", "main: unpack 2",
        "host: drain",
    ]


def test_one_copy_table_runs_under_the_first_transfer() -> None:
    tables = _tables(2, 3, 0)
    t, log, _ = _transport(tables, sliced=False)
    t.run(tables, _session())
    lines = _steps(log)
    assert lines.index("main: pack 1") < lines.index("main: copy 0") < lines.index("main: wait e1")
    assert sum(line.startswith("main: copy") for line in lines) == 1


def test_grid_cap_beside_transfers() -> None:
    tables = _tables(2, 3, 0)
    t, log, _ = _transport(tables, max_blocks=66)
    t.run(tables, _session())
    launches = [line for line in log.lines if re.match(r"main: (pack|copy|unpack)", line)]
    assert len(launches) == 9 and all(line.endswith(" cap 66") for line in launches)


@pytest.mark.parametrize("verify_cap", [0, 40])
def test_verified_executes_have_their_own_grid_cap(verify_cap: int) -> None:
    """Hashing makes a verified execute's kernels compute-bound: by default (0) they run
    uncapped where plain executes are capped. Its same-rank copies hash nothing and keep
    the plain cap (uncapped, they slow the transfer as in a plain execute)."""
    tables = _tables(2, 3, 0)
    t, log, _ = _transport(tables, max_blocks=66)
    t.executor.verify_max_blocks = verify_cap
    t.executor.build_verify()
    for verify in (True, False):
        t.executor.begin(MAIN, verify, False)
        t.executor.pack_first()
        t.executor.run([1], True, 1.0)
    launches = [line for line in log.lines if re.match(r"main: (pack|copy|unpack) ", line)]
    verified, plain = launches[:9], launches[9:]
    assert len(plain) == 9 and all(" cap 66" in line for line in plain), plain
    copies = [line for line in verified if line.startswith("main: copy ")]
    hashing = [line for line in verified if not line.startswith("main: copy ")]
    assert len(copies) == 3 and all(line.endswith(" cap 66") for line in copies), copies
    assert len(hashing) == 6 and all(("cap" in line) == bool(verify_cap) for line in hashing), hashing
    assert not verify_cap or all(f" cap {verify_cap}" in line for line in hashing)


def test_plan_without_transfers_only_copies() -> None:
    # All-local plans (TP1 -> TP2 collocated): the copies, uncapped, no pack, no transfer, no wait.
    mesh = Mesh([0])
    lay = Layout((1024,), torch.float32, mesh, [Replicate()])
    tables = bind_all({"x": lay}, {"x": lay}, 1, 0)[0]
    t, log, _ = _transport(tables, max_blocks=66, sliced=False)
    assert t.peers == []
    t.run(tables, _session())
    assert log.lines == ["main: copy 0"]


def test_run_cpu_time_is_measured_only_when_asked() -> None:
    """host_overhead --phases: Executor.last_run_times splits a run's host time (thread CPU,
    wall) into the posts and launches and the host wait for the transfers, with
    set_time_host(True) only."""
    tables = _tables(2, 3, 0)
    t, log, _ = _transport(tables)
    t.run(tables, _session())
    assert t.executor.last_run_times == [0.0] * 4
    t.executor.set_time_host(True)
    t.run(tables, _session())
    posts, posts_wall, wait, wait_wall = t.executor.last_run_times
    assert posts > 0.0 and posts_wall > 0.0  # a run that posts three batches takes some time
    assert wait >= 0.0 and wait_wall >= 0.0
    assert "host: drain" in log.lines


def test_trace_reports_every_step() -> None:
    tables = _tables(2, 2, 0)
    t, _, _ = _transport(tables, trace=True)
    t.run(tables, _session())
    steps = [line.split(":")[0].strip() for line in t.last_timeline.splitlines()[1:]]
    assert steps == ["pack 0", "transfer 0", "pack 1", "transfer 1", "copy 0", "unpack 0", "copy 1", "unpack 1"]


@pytest.mark.parametrize("batches, rounds", [(1, 8), (2, 4), (3, 2)])
def test_verify_rounds_digest_each_round_as_it_lands(batches: int, rounds: int) -> None:
    """NCCL verify: the last batch moves in rounds (fewer, the more batches there are: its
    last round, digested after every transfer, stays an eighth of the bytes or less); the
    digest of round r waits for round r's end only, capped, but the very last one runs at
    full width. Earlier batches move whole."""
    assert _C.verify_rounds(batches) == rounds
    tables = _tables(2, batches, 1 << 16)
    last = batches - 1
    assert tables.direct_recvs(last)
    t, log, transport = _transport(tables, rounds=True, max_blocks=66)
    t.executor.verify_max_blocks = 66  # as rx.Options(max_blocks=66) sets it
    slots = t.executor.build_verify()
    assert slots == sum(len(tables.pack_ops(b)) + len(tables.direct_sends(b)) + len(tables.unpack_ops(b))
                        + len(tables.direct_recvs(b)) for b in range(batches))
    t.executor.begin(MAIN, True, False)
    t.executor.pack_first()
    t.executor.run([1], True, 1.0)
    lines = log.lines
    posts = [line for line in lines if line.startswith("side: post")]
    assert [p.split(" sends")[0] for p in posts] == [f"side: post {b}" for b in range(last)] + \
        [f"side: post {last} r{r}" for r in range(rounds)]
    ends = [line.split("record ")[1] for line in lines if line.startswith("side: record")][last:]
    assert len(ends) == rounds
    for r, e in enumerate(ends):
        wait = lines.index(f"main: wait {e}")
        digest = next(i for i, line in enumerate(lines) if line.startswith(f"main: direct recvs {last} r{r} "))
        assert wait < digest and lines[digest].endswith("pass 3")
        assert ("cap 66" in lines[digest]) == (r + 1 < rounds)
    # the pack and unpack digest (PASS_COPY), the direct sends are read (PASS_SRC) once posted
    assert "main: pack 0 cap 66 digest 0 pass 1" in lines
    direct_sends = [i for i, line in enumerate(lines) if line.startswith(f"main: direct sends {last}")]
    assert len(direct_sends) == 1 and direct_sends[0] > lines.index(posts[-1])
    assert sum(m.bytes for m in transport.received) == sum(m.bytes for b in range(batches)
                                                           for m in tables.messages(b)[1])


def _degraded(good: set, writes: bool, status: int = 0) -> tuple[list[str], str, Any, Any]:
    """Rank 0 of 3, whose header exchange found that peer 2 disagrees."""
    tables = _tables(3, 1, 1 << 16)
    t, log, transport = _transport(tables)
    assert t.peers == [1, 2]
    t._agree = lambda tables, session, pack0: (pack0() if status == 0 else None, (good, writes))[1]
    session = _session()
    session.status, session.error = status, "local check failed"
    session.verdict = Verdict({2: "ranks 0 and 2 ran different plans"}, {})
    with pytest.raises(ReshardError) as e:
        t.run(tables, session)
    return list(log.lines), str(e.value), transport, tables


def test_degraded_rank_moves_agreeing_pairs_only_and_writes_nothing() -> None:
    lines, error, transport, tables = _degraded(good={1}, writes=False)
    posts = [line for line in lines if "post" in line]
    assert len(posts) == 1 and "(2," not in posts[0] and posts[0].endswith(" partial")
    assert not any("copy" in line or "unpack" in line for line in lines)  # no destination written
    # what arrives from rank 1 lands in staging or scratch memory, never in a tensor
    expected = [m for m in tables.messages(0)[1] if m.peer == 1]
    assert [(m.peer, m.bytes) for m in transport.received] == [(m.peer, m.bytes) for m in expected]
    direct = [(m.ptr, e.ptr) for m, e in zip(transport.received, expected) if m.ptr != e.ptr]
    assert direct and all(got >= 1 << 56 for got, _ in direct)  # the recording device's scratch
    assert lines[-1] == "main: synchronize"  # the scratch memory outlives the transfers
    assert "ranks 0 and 2 ran different plans" in error and "wrote no destination" in error


def test_rank_with_a_local_problem_moves_nothing() -> None:
    lines, error, _, _ = _degraded(good=set(), writes=False, status=1)
    assert lines == []  # no pack, no transfer, no copy
    assert error == "local check failed"


def test_abort_during_the_transfers_says_so() -> None:
    tables = _tables(2, 1, 0)
    t, _, transport = _transport(tables)
    transport.fail_drain = "NCCL communicator is unusable after an earlier failure: it was aborted"
    session = _session()
    session.abort.set()
    with pytest.raises(ReshardError, match="aborted \\(plan.abort\\(\\)\\) while the NCCL transfers ran"):
        t.run(tables, session)
    session = _session()
    with pytest.raises(ReshardError, match="^NCCL communicator is unusable"):
        t.run(tables, session)


def _verifying(t: Any) -> None:
    """The digest buffer of t's verified executes, on the CPU (CudaTransport._verified's work)."""
    slots = t.executor.build_verify()
    t._digests = torch.zeros(max(slots, 1), dtype=torch.int64)
    t._signs = torch.zeros_like(t._digests)
    t.executor.set_digests(t._digests.data_ptr())


def test_a_verified_execute_leaves_the_host_wait_to_its_check() -> None:
    """A verified execute returns once its work is queued; the check queues its own GPU work
    and only then waits for the transfers (settle). A plain execute waits itself."""
    tables = _tables(2, 3, 0)
    t, log, _ = _transport(tables)
    _verifying(t)
    digests = t.run(tables, _session(), verify=True)
    assert "host: drain" not in log.lines and any(line.startswith("main: unpack 2") for line in log.lines)
    digests.settle()
    digests.settle()  # once only
    assert log.lines.count("host: drain") == 1 and log.lines[-1] == "host: drain"
    log.clear()
    assert t.run(tables, _session()) is None
    assert log.lines.count("host: drain") == 1


def test_a_verified_execute_aborted_during_its_transfers_says_so_at_the_check() -> None:
    tables = _tables(2, 1, 0)
    t, log, transport = _transport(tables)
    _verifying(t)
    transport.fail_drain = "NCCL communicator is unusable after an earlier failure: it was aborted"
    session = _session()
    session.abort.set()
    digests = t.run(tables, session, verify=True)
    with pytest.raises(ReshardError, match="aborted \\(plan.abort\\(\\)\\) while the NCCL transfers ran"):
        digests.settle()
    # An execute whose check never ran leaves its wait to the next begin, whose failure it
    # does not raise: that execute raised already, and the aborted communicator is rebuilt.
    t.run(tables, _session(), verify=True)
    log.clear()
    t.executor.begin(MAIN, False, False)
    assert log.lines[0] == "host: drain"


def test_grid_cap_only_for_ranks_that_send_and_receive(monkeypatch: pytest.MonkeyPatch) -> None:
    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: Props())
    gb = 1 << 30
    assert cuda_transport._max_blocks(8 * gb, 8 * gb, 8 * gb) == 66  # TP2->TP1: equal bytes
    assert cuda_transport._max_blocks(8 * gb, 7 * gb, 0) == 66
    assert cuda_transport._max_blocks(7 * gb, 7 * gb, 9 * gb) == 99  # MoE EP2->EP1: copies 1.3x
    assert cuda_transport._max_blocks(8 * gb, 0, 9 * gb) == 0  # one-way ranks stay uncapped
    assert cuda_transport._max_blocks(0, 8 * gb, 0) == 0
    assert cuda_transport._max_blocks(0, 8 * gb, 0, override=40) == 40
    assert cuda_transport._max_blocks(8 * gb, 8 * gb, 8 * gb, override=0) == 0


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _traced_refit_rows(rank: int, world: int) -> list[tuple[str, float, float]]:
    """NCCL, several batches, traced: a refit and a verified one (in rounds) land bit for
    bit; returns the verified execute's timeline rows (step, begin ms, end ms)."""
    import reshard_ext as rx

    shape = (256, 4096)  # row shards -> whole tensor: 2 MiB each way, in direct messages
    sl = Layout(shape, torch.float32, Mesh([0, 1]), [Shard(0)])
    dl = Layout(shape, torch.float32, Mesh([0, 1]), [Replicate()])
    full = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    dst = torch.zeros(dl.local_shape(rank), device="cuda")
    plan = rx.plan({"w": (sl.local_part(full, rank).cuda(), sl)}, {"w": (dst, dl)},
                   options=rx.Options(trace=True, tuning=rx.Tuning(direct_bytes=1 << 16, batch_bytes=1 << 18)),
                   backend="nccl")
    assert plan.num_batches > 1
    rx.execute(plan)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), full)
    plain = plan.transport.last_timeline.splitlines()[1:]
    assert any(line.strip().startswith("transfer 1") for line in plain), plain
    dst.zero_()
    rx.execute(plan, verify=True)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), full)
    rows = []
    for line in plan.transport.last_timeline.splitlines()[1:]:
        step, times = line.split(":")
        begin, end = times.replace("ms", "").split("->")
        rows.append((step.strip(), float(begin), float(end)))
    return rows


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_traced_nccl_refit_reports_each_step_in_order_2gpu() -> None:
    from _dist import run_ranks

    for rows in run_ranks(2, _traced_refit_rows, backend="nccl"):
        assert rows[0][0] == "pack 0" and rows[0][1] == 0.0
        assert all(0.0 <= begin <= end for _, begin, end in rows), rows
        steps = [s for s, _, _ in rows]
        last = max(int(s.split()[-1]) for s in steps if s.startswith("transfer"))  # rounds: the last batch only
        n = _C.verify_rounds(last + 1)
        assert "transfer 0" in steps and f"transfer r0 {last}" in steps and f"digest r{n - 1} {last}" in steps, steps
        assert steps.index(f"transfer r0 {last}") < steps.index(f"digest r0 {last}") < steps.index(f"unpack {last}")
