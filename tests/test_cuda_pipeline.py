"""The GPU transport's launch order, checked on any machine: fake streams, events, tables
and communicator record what CudaTransport.run asks of them, so the pipelining (pack k+1
and then the copy slice of k under transfer k, unpack k only after transfer k) and the trace
timeline are tested without a GPU."""
from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from reshard_ext.transports import cuda as cuda_transport
from reshard_ext.errors import ReshardError
from reshard_ext.transports.channel import Session, Verdict

LOG: list[str] = []


class FakeEvent:
    count = 0

    def __init__(self, enable_timing: bool = False) -> None:
        FakeEvent.count += 1
        self.name = f"e{FakeEvent.count}"
        self.time = 0.0

    def record(self, stream: "FakeStream") -> None:
        self.time = float(len(LOG))
        LOG.append(f"{stream.name}: record {self.name}")

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.time - self.time


class FakeStream:
    device = "cpu"

    def __init__(self, name: str) -> None:
        self.name = name
        self.cuda_stream = name

    def synchronize(self) -> None:
        LOG.append(f"{self.name}: synchronize")

    def wait_stream(self, other: "FakeStream") -> None:
        LOG.append(f"{self.name}: wait {other.name}")

    def record_event(self) -> FakeEvent:
        e = FakeEvent()
        e.record(self)
        return e

    def wait_event(self, e: FakeEvent) -> None:
        LOG.append(f"{self.name}: wait {e.name}")


class FakeTable:
    def __init__(self, name: str) -> None:
        self.name = name

    def launch(self, stream: str, max_blocks: int = 0) -> None:
        LOG.append(f"{stream}: {self.name}")


class FakeComm:
    timeout = 1.0
    usable = True

    def exchange(self, sends: Any, recvs: Any, stream: str, flags: int) -> None:
        LOG.append(f"{stream}: exchange {sends}")

    def wait(self, timeout: float) -> None:
        LOG.append("host: comm.wait")


def _transport(monkeypatch: pytest.MonkeyPatch, batches: int, copies: int) -> cuda_transport.CudaTransport:
    main = FakeStream("main")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: main)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    t = object.__new__(cuda_transport.CudaTransport)
    t.comm, t.p2p, t.side, t.last_timeline = FakeComm(), None, FakeStream("side"), ""
    t.max_blocks, t._registered, t._moves, t.trace = 0, [], True, False
    t._pack = [FakeTable(f"pack {b}") for b in range(batches)]
    t._unpack = [FakeTable(f"unpack {b}") for b in range(batches)]
    t._copy = [FakeTable(f"copy {c}") for c in range(copies)]
    t._messages = [(f"s{b}", f"r{b}") for b in range(batches)]
    t.peers, t.channel = [1], type("FakeChannel", (), {"rank": 0})()
    # Every peer agrees (the header exchange runs the first pack while headers travel).
    t._agree = lambda tables, session, pack0: (pack0(), ({1}, True))[1]
    LOG.clear()
    FakeEvent.count = 0
    return t


def _session() -> Session:
    return Session(plan_id=1, seq=1, version=None, status=0, deadline=1e18, timeout=1.0, abort=threading.Event())


def test_pipeline_order(monkeypatch: pytest.MonkeyPatch) -> None:
    _transport(monkeypatch, batches=3, copies=3).run(None, _session())
    assert LOG == [
        "main: pack 0", "side: wait main", "side: exchange s0", "side: record e1",
        "main: pack 1", "side: wait main", "side: exchange s1", "side: record e2",  # posted before waiting for 0
        "main: copy 0",  # under transfer 0, after the pack of 1: it never delays transfer 1
        "main: wait e1", "main: unpack 0",
        "main: pack 2", "side: wait main", "side: exchange s2", "side: record e3",
        "main: copy 1", "main: wait e2", "main: unpack 1",
        "main: copy 2", "main: wait e3", "main: unpack 2",
        "host: comm.wait",
    ]


def test_one_copy_table_runs_under_the_first_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    _transport(monkeypatch, batches=2, copies=1).run(None, _session())
    assert LOG.index("main: pack 1") < LOG.index("main: copy 0") < LOG.index("main: wait e1")


def test_plan_without_transfers_only_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    # All-local plans (TP1 -> TP2 collocated): the copies, no pack, no NCCL call, no wait.
    t = _transport(monkeypatch, batches=1, copies=1)
    t._moves, t.peers = False, []
    t.run(None, _session())
    assert LOG == ["main: copy 0"]


def test_trace_reports_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    t = _transport(monkeypatch, batches=2, copies=2)
    t.trace = True
    t.run(None, _session())
    steps = [line.split(":")[0].strip() for line in t.last_timeline.splitlines()[1:]]
    assert steps == ["pack 0", "transfer 0", "pack 1", "transfer 1", "copy 0", "unpack 0", "copy 1", "unpack 1"]


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


def _degraded(monkeypatch: pytest.MonkeyPatch, good: set, writes: bool, status: int = 0) -> list[str]:
    """A rank whose header exchange found disagreeing peers: 1 agrees, 2 does not."""
    t = _transport(monkeypatch, batches=1, copies=1)
    staging = torch.empty(64, dtype=torch.uint8)
    t.recv, t.peers = [staging], [1, 2]
    base = staging.data_ptr()
    # to/from peer 1: one staged message and one straight into a tensor (a direct one)
    t._messages = [([(1, 10, 8), (2, 20, 8)], [(1, base, 8), (1, 999_000, 4), (2, base + 16, 8)])]
    t._agree = lambda tables, session, pack0: (pack0() if status == 0 else None, (good, writes))[1]
    session = _session()
    session.status, session.error = status, "local check failed"
    session.verdict = Verdict({2: "is executing another plan"}, {})
    received: list = []
    exchange = t.comm.exchange
    t.comm.exchange = lambda sends, recvs, stream, flags: (received.extend(recvs), exchange(sends, recvs, stream, flags))
    with pytest.raises(ReshardError) as e:
        t.run(None, session)
    if received:  # peer 1 only; its direct message lands in scratch memory, not in the tensor at 999000
        assert [(p, n) for p, _, n in received] == [(1, 8), (1, 4)] and received[0][1] == base
        assert received[1][1] != 999_000
    return LOG + [str(e.value)]


def test_degraded_rank_moves_agreeing_pairs_only_and_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    log = _degraded(monkeypatch, good={1}, writes=False)
    exchange = [line for line in log if "exchange" in line]
    assert exchange == ["side: exchange [(1, 10, 8)]"]  # nothing to or from rank 2
    assert not any("copy" in line or "unpack" in line for line in log)  # no destination written
    assert "rank 2: is executing another plan" in log[-1] and "wrote no destination" in log[-1]


def test_rank_with_a_local_problem_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    log = _degraded(monkeypatch, good=set(), writes=False, status=1)
    assert log[:-1] == []  # no pack, no transfer, no copy
    assert log[-1] == "local check failed"


def test_abort_during_the_transfers_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    t = _transport(monkeypatch, batches=1, copies=0)
    session = _session()

    def aborted(timeout: float) -> None:
        session.abort.set()
        raise ReshardError("NCCL communicator is unusable after an earlier failure: it was aborted")

    t.comm.wait = aborted
    with pytest.raises(ReshardError, match="aborted \\(plan.abort\\(\\)\\) during the NCCL transfers"):
        t.run(None, session)
