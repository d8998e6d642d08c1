"""One answer on every rank (DESIGN section 2): an execute, rx.verify or a swap returns on
every rank of the plan's group only if every rank's part landed, else it raises on every
rank, naming the ranks that failed and why.

After its data moved (or failed to), each rank tells every other one how its part ended,
in one small exchange at the end of the execute:

- every rank of the group on one host (a node of GPUs, CPU processes): one row from each
  rank to each other one through the host mailboxes, a few microseconds;
- otherwise recursive doubling over the channel's pair connections: log2(N) rounds, each
  one message each way with one peer carrying what its side knows so far (bitmaps of the
  ranks that failed, the range of versions and verify flags, the digest sums).

A rank that failed raises its alarm (Channel.raise_alarm, its causes in words) before it
posts its row, so every rank reads the same causes. The exchange is bounded by the
execute's deadline and GRACE_S more; it does not wait for a rank whose
process is gone, that left the execute (plan.abort() on one host), or that another rank
already gave up on. The answer is the same on every rank except where a rank stalls or
dies within this exchange itself: then the ranks that miss its row raise and the others,
whose data all landed, return.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .channel import HAS_VERSION, HEADER_LEN, VERIFIES, VERIFY_SPLIT, VERSION_SPLIT, Channel, Session, data_token

OUTCOME_TAG = 3  # gloo tag of the recursive doubling's messages (data tags start at 2 + ...)
GRACE_S = 2.0  # how long the exchange waits past the execute's deadline
_MAGIC = 0x52584f43  # "RXOC"
# A row (the mailbox path): one rank's outcome.
MAGIC, PLAN, SEQ, STATUS, VERSION, FLAGS, GAVE_UP, LO, HI, DIFFER, ATTEMPT = range(HEADER_LEN)
HAS_SUMS = 64  # FLAGS bit: LO, HI, DIFFER are a verify check's digest sums
OWN_PROBLEM = 128  # FLAGS bit: the rank failed a check of its own (its version and verify= do not count)
_AGREE = [MAGIC, PLAN, STATUS, VERSION, FLAGS]  # the fields every row of an execute that landed has alike
OK, FAILED, STOPPED, MISSING = 0, 1, 2, 3  # how a rank's part ended (MISSING: no row)
NAMED = "-"  # why a rank is missing: another rank's cause names it already
OTHER_PLANS = "ran different plans"
# The union (the recursive doubling): fixed fields, then three bitmaps of ranks (failed at all;
# failed with a cause of their own; not heard from by some rank).
(U_MAGIC, U_PLAN, U_SEQ, U_VMIN, U_VMAX, U_HMIN, U_HMAX, U_FMIN, U_FMAX, U_LO, U_HI, U_DIFFER, U_SUMS,
 U_ATTEMPT) = range(14)
_U_FIXED = 14
_I64_MAX, _I64_MIN = (1 << 63) - 1, -(1 << 63)


@dataclass
class Part:
    """How this rank's part of an execute ended, as it tells the others."""

    status: int = OK
    lines: list[str] = field(default_factory=list)  # FAILED: its causes, one line each, in words
    gave_up: int = -1  # the lowest rank it stopped waiting for in the data phase (-1: none)
    sums: np.ndarray | None = None  # a verify check's (lo, hi, differ) to add up (rx.verify, CPU)
    late_by: float = 0.0  # how far past the execute's deadline this rank came to the exchange


@dataclass
class Outcome:
    """What every rank agreed on."""

    status: dict[int, int]  # every rank of the group: OK, FAILED, STOPPED or MISSING
    lines: list[str]  # the causes, each once
    seq: int  # the largest execute number any rank reported (every rank meets there)
    sums: np.ndarray | None = None  # the group's digest sums, where every rank folded them
    # every rank answered from this plan's call (or left it: plan.abort()), so the call counts
    # for this plan's execute numbers; else it counts for none
    counts: bool = True
    # ranks this rank has no word from (no row or union, no alarm, not named as given up on):
    # whether their part landed is not known here
    unknown: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.lines and all(s == OK for s in self.status.values())

    def message(self, what: str) -> str:
        """The error every rank raises: the causes, then which ranks' parts did not land."""
        bad = sorted(r for r, s in self.status.items() if s != OK and r not in self.unknown)
        lines = list(self.lines) or [f"rank {r} failed" for r in bad]
        landed = sorted(r for r, s in self.status.items() if s == OK)
        unknown = f"ranks {sorted(self.unknown)} not known to this rank (no word from them)" if self.unknown else ""
        if not bad and not unknown:
            tail = "every rank's data landed, but the ranks disagree as above"
        elif not bad:
            tail = unknown + (f"; completed on ranks {landed}" if landed else "")
        else:
            tail = (f"not completed on ranks {bad} (their destinations are not, or only partly, updated)"
                    + (f"; completed on ranks {landed}" if landed else "") + (f"; {unknown}" if unknown else ""))
        return (f"{what} failed on every rank (plan.version is None everywhere):\n  " + "\n  ".join(lines)
                + f"\n  {tail}")


def _row(session: Session, part: Part) -> np.ndarray:
    row = np.zeros(HEADER_LEN, dtype=np.int64)
    flags = (HAS_VERSION if session.version is not None else 0) | (VERIFIES if session.verify else 0)
    row[[MAGIC, PLAN, SEQ, STATUS, VERSION, GAVE_UP, ATTEMPT]] = (_MAGIC, session.plan_id, session.seq, part.status,
                                                                  session.version or 0, part.gave_up, session.attempt)
    if session.status != 0:
        flags |= OWN_PROBLEM
    if part.sums is not None:
        flags |= HAS_SUMS
        row[[LO, HI, DIFFER]] = part.sums
    row[FLAGS] = flags
    return row


def _final_session(session: Session) -> Session:
    """The exchange's own session: the execute's deadline and GRACE_S more (a rank that
    waited out the deadline in its data phase comes then), and an abort flag of its own (an
    abort after the data must not cut the answer short)."""
    deadline = max(session.deadline, time.monotonic()) + min(GRACE_S, session.timeout)
    return Session(session.plan_id, session.seq, session.version, 0, deadline, session.timeout, _NEVER,
                   verify=session.verify)


_NEVER = threading.Event()  # the exchange's abort flag: nothing sets it


def agree(channel: Channel, session: Session, part: Part) -> Outcome:
    """The outcome of `session`'s execute on every rank of the channel's group (collective)."""
    part.late_by = max(0.0, time.monotonic() - session.deadline)
    final = _final_session(session)
    if channel.size == 1:
        return _decide(channel, session, {channel.rank: _row(session, part)}, part, {}, set())
    if channel.all_local():
        mine = _row(session, part)
        rows, missing, left, taken = _mailbox_rows(channel, final, mine, part.gave_up)
        # every row equal to ours in what must agree, and every part landed: the common case, at once
        if not missing and part.status == OK and (taken[:, _AGREE] == mine[_AGREE]).all():
            sums = (taken[:, [LO, HI, DIFFER]].sum(axis=0) + mine[[LO, HI, DIFFER]]) if part.sums is not None else None
            return Outcome(dict.fromkeys(range(channel.size), OK), [], max(int(taken[:, SEQ].max()), session.seq),
                           sums)
        return _decide(channel, session, rows, part, missing, left)
    return _doubling(channel, final, session, part)


# --- one host: a row from every rank -------------------------------------------------------
def _mailbox_rows(channel: Channel, session: Session, mine: np.ndarray,
                  gave_up: int) -> tuple[dict[int, np.ndarray], dict[int, str], set[int], np.ndarray]:
    """Every rank's row (those that came), why none came from the others, which of them
    left the execute (plan.abort()), and the other ranks' rows as one array. gave_up: a
    rank this one stopped waiting for."""
    others = channel.others
    rows = np.zeros((len(others), HEADER_LEN), dtype=np.int64)
    skip: dict[int, str] = {gave_up: NAMED} if gave_up >= 0 else {}
    left: set[int] = set()
    ticks = 0

    def enough(unfinished: list[int]) -> bool:
        """Whether every rank still missing is one nobody waits for."""
        nonlocal ticks
        ticks += 1
        for r, alarm in channel.alarms(session, unfinished, remote=False).items():
            if alarm.left:
                skip.setdefault(r, alarm.why)
                left.add(r)
        if ticks % 5 == 0:
            for r in channel.gone(unfinished):
                skip.setdefault(r, f"rank {r}: its process exited during the execute (killed or crashed)")
        given_up = {int(row[GAVE_UP]) for row in rows if row[MAGIC] == _MAGIC and row[GAVE_UP] >= 0}
        for r in unfinished:
            if r in given_up:
                skip.setdefault(r, NAMED)
        return all(r in skip for r in unfinished)

    failed = channel.mailbox_exchange(others, mine, rows, session, enough=enough)
    got = {r: row for r, row in zip(others, rows) if r not in failed}
    got[channel.rank] = mine
    missing = {r: skip.get(r, "") for r in failed}
    return got, missing, left & set(failed), rows


# --- several hosts: recursive doubling -------------------------------------------------------
def _union_of(n: int, session: Session, part: Part) -> np.ndarray:
    words = (n + 63) // 64
    u = np.zeros(_U_FIXED + 3 * words, dtype=np.int64)
    has = 1 if session.version is not None else 0
    v = session.version or 0
    f = 1 if session.verify else 0
    u[[U_MAGIC, U_PLAN, U_SEQ, U_ATTEMPT]] = _MAGIC, session.plan_id, session.seq, session.attempt
    # a rank with a problem of its own: its version and verify= do not count (min > max merges as nothing)
    u[[U_VMIN, U_VMAX, U_HMIN, U_HMAX, U_FMIN, U_FMAX]] = (v, v, has, has, f, f) if session.status == 0 else (
        _I64_MAX, _I64_MIN) * 3
    if part.sums is not None:
        u[[U_LO, U_HI, U_DIFFER]] = part.sums
        u[U_SUMS] = 1
    return u


FAILED_BITS, CAUSED_BITS, MISSING_BITS = range(3)  # the union's bitmaps of ranks


def _mark(u: np.ndarray, n: int, rank: int, *bitmaps: int) -> None:
    words = (n + 63) // 64
    bit = np.int64(1) << np.int64(rank % 64)
    for m in bitmaps:
        u[_U_FIXED + m * words + rank // 64] |= bit


def _bits(u: np.ndarray, n: int, bitmap: int) -> list[int]:
    base = _U_FIXED + bitmap * ((n + 63) // 64)
    return [r for r in range(n) if (int(u[base + r // 64]) >> (r % 64)) & 1]


def _merge(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The union of two sides' knowledge (disjoint sets of ranks)."""
    out = a.copy()
    out[U_SEQ] = max(a[U_SEQ], b[U_SEQ])
    for lo, hi in ((U_VMIN, U_VMAX), (U_HMIN, U_HMAX), (U_FMIN, U_FMAX)):
        out[lo], out[hi] = min(a[lo], b[lo]), max(a[hi], b[hi])
    out[[U_LO, U_HI, U_DIFFER]] = a[[U_LO, U_HI, U_DIFFER]] + b[[U_LO, U_HI, U_DIFFER]]
    out[U_SUMS] = a[U_SUMS] & b[U_SUMS]
    out[_U_FIXED:] = a[_U_FIXED:] | b[_U_FIXED:]
    return out


def _post(channel: Channel, session: Session, ops: list) -> bool:
    """Posts one round's messages on the outcome lane; False where the pair failed."""
    lane = channel.outcome_lane()
    return not lane.wait(lane.submit(lambda: lane.exchange(ops, OUTCOME_TAG, session, retry_closed=True)), session,
                         "agreeing on the outcome")


def _talk_to(channel: Channel, session: Session, execute: Session, peer: int, u: np.ndarray, send: bool,
             size: int, sent: set[int]) -> np.ndarray | None:
    """Sends our union `u` to the peer (send) and receives its union (size > 0); None where
    the pair failed (the peer is missing) or it is at a later attempt of this execute.
    sent: the peers this rank sent its union to in this exchange.

    Between hosts a rank the others gave up on may still be in the call they retry: its
    messages carry the attempt it is at (Session.attempt). A union of an earlier attempt is
    dropped and the next one read; one of a later attempt is kept for this rank's own next
    attempt (Channel.early) where this rank's attempt was confirmed (by a header or a
    row), else this rank joins that attempt (it skipped the failed call) and sends again
    where it sent before."""
    early = channel.outcome_lane().early
    key = (peer, execute.plan_id, execute.seq)
    got = early.pop(key + (execute.attempt,), None) if size else None
    theirs = torch.zeros(max(size, 1), dtype=torch.int64)
    ops = [("send", peer, torch.from_numpy(u.copy()))] if send else []
    ops += [("recv", peer, theirs)] if size and got is None else []
    if send:
        sent.add(peer)
    if ops and not _post(channel, session, ops):
        return None
    if not size:
        return theirs.numpy()
    if got is None:
        got = theirs.numpy().copy()
    while True:
        if got[U_MAGIC] != _MAGIC:
            return None
        if (int(got[U_PLAN]), int(got[U_SEQ])) != key[1:]:
            return got  # another plan or execute: the caller says so
        attempt = int(got[U_ATTEMPT])
        if attempt == execute.attempt:
            execute.attempt_fixed = True
            return got
        if attempt > execute.attempt and execute.attempt_fixed:
            early[key + (attempt,)] = got
            return None
        if attempt > execute.attempt:
            execute.attempt, execute.attempt_fixed = attempt, True
            u[U_ATTEMPT] = attempt
            if peer in sent and not _post(channel, session, [("send", peer, torch.from_numpy(u.copy()))]):
                return None
            return got
        if not _post(channel, session, [("recv", peer, theirs)]):
            return None
        got = theirs.numpy().copy()


def _doubling(channel: Channel, session: Session, execute: Session, part: Part) -> Outcome:
    n, me = channel.size, channel.rank
    early = channel.outcome_lane().early
    for passed in [e for e in early if e[1] == execute.plan_id and (e[2], e[3]) < (execute.seq, execute.attempt)]:
        del early[passed]  # kept for an attempt this rank has passed
    u = _union_of(n, execute, part)
    size = u.size
    if part.status != OK:
        _mark(u, n, me, FAILED_BITS, *((CAUSED_BITS,) if part.status == FAILED else ()))
    if part.gave_up >= 0:
        _mark(u, n, part.gave_up, FAILED_BITS, MISSING_BITS)
    p2 = 1 << (n.bit_length() - 1)  # the largest power of two <= n: ranks past it fold in first
    missing: dict[int, str] = {}
    plan = int(u[U_PLAN])
    other_plan = False

    def lost(peer: int, first: int, count: int) -> None:
        for r in range(first, min(first + count, n)):
            _mark(u, n, r, FAILED_BITS, MISSING_BITS)
        missing.setdefault(peer, "")

    sent: set[int] = set()

    def _talk(peer: int, send: bool, size: int) -> np.ndarray | None:
        nonlocal other_plan
        got = _talk_to(channel, session, execute, peer, u, send, size, sent)
        if got is not None and size and int(got[U_PLAN]) != plan:  # it ran another plan: the headers said why
            other_plan = True
            return None
        return got

    if me >= p2:  # hands its part to me - p2, which hands back the whole group's
        if me - p2 == part.gave_up or _talk(me - p2, True, 0) is None:
            lost(me - p2, me - p2, 1)
        else:
            got = _talk(me - p2, False, size)
            if got is None:
                lost(me - p2, 0, n)
            else:
                u = got
    else:
        folded = me + p2 < n and me + p2 != part.gave_up
        if me + p2 < n and not folded:
            lost(me + p2, me + p2, 1)
            missing[me + p2] = NAMED
        if folded:
            got = _talk(me + p2, False, size)
            if got is None:
                lost(me + p2, me + p2, 1)
                folded = False
            else:
                u = _merge(u, got)
        k = 1
        while k < p2:
            peer = me ^ k
            if peer == part.gave_up:  # it did not answer in the data phase: not waited for again
                lost(peer, peer & ~(k - 1), k)
                missing[peer] = NAMED
                k <<= 1
                continue
            got = _talk(peer, True, size)
            if got is None:
                lost(peer, peer & ~(k - 1), k)
            else:
                u = _merge(u, got)
            k <<= 1
        if folded:
            _talk(me + p2, True, 0)
    status = {r: OK for r in range(n)}
    for r in _bits(u, n, FAILED_BITS):
        status[r] = STOPPED
    for r in _bits(u, n, CAUSED_BITS):
        status[r] = FAILED
    for r in missing:
        status[r] = MISSING
    unheard = [r for r in _bits(u, n, MISSING_BITS) if r != me]
    lines, unknown = _causes(channel, execute, status, part, missing, unheard=unheard)
    if other_plan and not any(OTHER_PLANS in x for x in lines):
        lines.append(f"the ranks {OTHER_PLANS} (ranks call rx.execute / rx.verify on plans in different orders, or one "
                     f"skipped one)")
    # the pairs' lines name the ranks; the group's range says it where no pair saw it
    if (u[U_VMIN] < u[U_VMAX] or u[U_HMIN] < u[U_HMAX]) and not any(VERSION_SPLIT in x for x in lines):
        lines.append(f"the ranks {VERSION_SPLIT} (from {_version(u, U_HMIN, U_VMIN)} to {_version(u, U_HMAX, U_VMAX)}; "
                     f"every rank must pass the same)")
    if u[U_FMIN] < u[U_FMAX] and not any(VERIFY_SPLIT in x for x in lines):
        lines.append(f"the ranks {VERIFY_SPLIT} (True and False; every rank must pass the same)")
    sums = u[[U_LO, U_HI, U_DIFFER]] if u[U_SUMS] and part.sums is not None else None
    return Outcome(status, _once(lines), int(u[U_SEQ]), sums, not other_plan and not _bits(u, n, MISSING_BITS),
                   unknown)


def _version(u: np.ndarray, has: int, v: int) -> str:
    return str(int(u[v])) if u[has] else "None"


# --- the answer ------------------------------------------------------------------------------
def _decide(channel: Channel, session: Session, rows: dict[int, np.ndarray], part: Part,
            missing: dict[int, str], left: set[int]) -> Outcome:
    n = channel.size
    status = {r: MISSING for r in range(n)}
    seq = session.seq
    mine = rows[channel.rank]
    tokens = {}
    for r, row in rows.items():
        status[r] = int(row[STATUS])
        seq = max(seq, int(row[SEQ]))
        tokens[r] = data_token(int(row[PLAN]), int(row[SEQ]))  # a rank on another plan: its alarm's
    counts = all(row[PLAN] == mine[PLAN] for row in rows.values()) and set(missing) <= left
    lines, unknown = _causes(channel, session, status, part, missing, tokens)
    plans: dict[int, list[int]] = {}
    for r, row in sorted(rows.items()):
        plans.setdefault(int(row[PLAN]), []).append(r)
    if len(plans) > 1 and not any(OTHER_PLANS in x for x in lines):
        for r in rows:
            status[r] = FAILED if status[r] == OK else status[r]
        lines.append(f"the ranks {OTHER_PLANS}: " + " and ".join(str(rs) for rs in plans.values()) +
                     " (ranks call rx.execute / rx.verify on plans in different orders, or one skipped one)")
    versions: dict[str, list[int]] = {}
    verifies: dict[bool, list[int]] = {}
    for r, row in sorted(rows.items()):
        if row[FLAGS] & OWN_PROBLEM:
            continue
        versions.setdefault(str(int(row[VERSION])) if row[FLAGS] & HAS_VERSION else "None", []).append(r)
        verifies.setdefault(bool(row[FLAGS] & VERIFIES), []).append(r)
    if len(versions) > 1:
        lines = _split(lines, VERSION_SPLIT, f"the ranks {VERSION_SPLIT}: " + ", ".join(
            f"{v} on ranks {rs}" for v, rs in sorted(versions.items(), key=lambda x: x[1])) +
            " (every rank must pass the same)")
    if len(verifies) > 1:
        lines = _split(lines, VERIFY_SPLIT, f"the ranks {VERIFY_SPLIT}: " + ", ".join(
            f"{v} on ranks {rs}" for v, rs in sorted(verifies.items())) + " (every rank must pass the same)")
    sums = None
    if part.sums is not None and all(r in rows and rows[r][FLAGS] & HAS_SUMS for r in range(n)):
        sums = np.sum([rows[r][[LO, HI, DIFFER]] for r in range(n)], axis=0)
    return Outcome(status, _once(lines), seq, sums, counts, unknown)


def _causes(channel: Channel, session: Session, status: dict[int, int], part: Part,
            missing: dict[int, str], tokens: dict[int, int] | None = None,
            unheard: Sequence[int] = ()) -> tuple[list[str], list[int]]:
    """The cause lines: this rank's own, the other failed ranks' (their alarms; tokens: the
    token of each rank's execute, where it differs from ours), those of the unheard ranks
    that raised an alarm (ranks whose union never reached this one: a pair on its way
    failed), and one per rank that did not report and that no alarm names as the rank it
    gave up on. Then the ranks whose part is not known here: unheard ranks without an
    alarm, and where this rank came late, those that did not wait for it."""
    lines: list[str] = []
    failed = [r for r, s in status.items() if s == FAILED]
    others = [r for r in failed if r != channel.rank]
    texts = channel.alarms(session, others, tokens=tokens, causes=True) if others else {}
    for r in failed:
        if r == channel.rank:
            lines += part.lines
        elif r in texts:
            lines += _lines(texts[r].why)
        else:
            lines.append(f"rank {r} failed (its own error says why)")
    unheard = [r for r in unheard if r not in failed and r not in missing]
    heard_of = channel.alarms(session, unheard, causes=True) if unheard else {}
    for _, alarm in sorted(heard_of.items()):
        lines += _lines(alarm.why)
    # a rank whose row is missing but whose alarm is there failed and left before this rank
    # came (this rank was late): its causes, not a guess at why it is silent
    silent = [r for r, why in missing.items() if not why]
    late = channel.alarms(session, silent, causes=True) if silent else {}
    named = {a.gave_up for a in (*texts.values(), *heard_of.values(), *late.values())}
    unexplained: list[int] = []
    for r, why in sorted(missing.items()):
        if why == NAMED or (not why and r not in late and r in named):
            continue
        why = why or (late[r].why if r in late else "")
        lines += _lines(why)
        if not why:
            unexplained.append(r)
    unknown = [r for r in unheard if r not in heard_of and r not in named]
    if unexplained and part.late_by > 0:  # they most likely came and left: this rank is the one that stalled
        lines.append(f"{_who(unexplained)} did not wait for this rank: rank {channel.rank} reached the end of its "
                     f"part {part.late_by:.1f} s past the {session.timeout:g} s timeout")
        unknown += unexplained
    elif unexplained:
        lines.append(f"{_who(unexplained)} did not reach the end of the execute within {session.timeout:g} s "
                     f"(stalled, died, or did not call it)")
    return lines, sorted(unknown)


def _lines(text: str) -> list[str]:
    """An alarm's cause lines (its text, one cause per line)."""
    return [line for line in text.split("\n") if line]


def _who(ranks: list[int]) -> str:
    """'rank 2', 'ranks 2 and 3', 'ranks 1, 2 and 3'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"


def _split(lines: list[str], what: str, summary: str) -> list[str]:
    """`lines` with the pairs' lines about `what` replaced by the group's `summary`."""
    return [x for x in lines if not (x.startswith("ranks ") and what in x)] + [summary]


SEE_RANK = ": see the error on rank "  # a line whose cause another rank's line gives


def _once(lines: list[str]) -> list[str]:
    """Each cause once: equal lines once, and a line that points at another rank's error
    dropped where a line of that rank's own is there."""
    out = list(dict.fromkeys(lines))

    def explained(x: str) -> bool:
        rank = x.split(SEE_RANK)[1].split(";")[0].split()[0]
        return any(y.startswith((f"rank {rank}:", f"rank {rank} ")) and SEE_RANK not in y for y in out)

    return [x for x in out if SEE_RANK not in x or not explained(x)]
