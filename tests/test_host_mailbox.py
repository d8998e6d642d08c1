"""_C.HostMailbox (csrc/comm/host_mailbox.h): execute headers between the processes of one
host through shared memory. Two mailboxes in one process stand for two ranks; each step
of the protocol runs when the test says, so every interleaving of the two ends is
checked: both ends always reach the same outcome."""
from __future__ import annotations

import numpy as np
import pytest

from reshard_ext import _C
from reshard_ext.errors import ReshardError

WORDS = 10
DONE, POSTED_NOTHING, TOOK_NOTHING = 0, 1, 2
KIND, OTHER_KIND = 0x52584844, 0x52584F43  # first words: what an exchange takes


def _pair():
    a, b = _C.HostMailbox(0, 2, WORDS), _C.HostMailbox(1, 2, WORDS)
    a.attach(1, b.name)
    b.attach(0, a.name)
    return a, b


def _header(base: int, kind: int = KIND) -> np.ndarray:
    h = np.arange(WORDS, dtype=np.int64) + base
    h[0] = kind
    return h


def _rows() -> np.ndarray:
    return np.zeros((1, WORDS), dtype=np.int64)


def test_both_ends_take_each_others_header_round_after_round():
    a, b = _pair()
    for r in range(5):
        ra, rb = _rows(), _rows()
        a.post([1], _header(100 * r))
        b.post([0], _header(100 * r + 50))
        assert not a.poll(0.0, ra)  # a took b's; b has not taken a's yet
        assert b.poll(0.0, rb) and a.poll(0.0, ra)
        assert a.finish(ra) == [DONE] and b.finish(rb) == [DONE]
        assert (ra[0] == _header(100 * r + 50)).all() and (rb[0] == _header(100 * r)).all()


def test_a_header_nobody_took_is_withdrawn_and_never_taken_later():
    a, b = _pair()
    ra, rb = _rows(), _rows()
    a.post([1], _header(0))
    assert not a.poll(0.001, ra)
    assert a.finish(ra) == [POSTED_NOTHING]
    b.post([0], _header(7))
    assert not b.poll(0.001, rb)  # a's withdrawn header is not there to take
    assert b.finish(rb) == [POSTED_NOTHING]
    assert (rb == 0).all()
    # a's next exchange meets b's next one
    a.post([1], _header(1))
    b.post([0], _header(8))
    assert b.poll(0.0, rb) is False and a.poll(0.0, ra) and b.poll(0.0, rb)
    assert a.finish(ra) == [DONE] and b.finish(rb) == [DONE]
    assert ra[0, 1] == 9 and rb[0, 1] == 2


def test_an_end_that_gives_up_after_its_header_was_taken_takes_the_peers_and_succeeds():
    """b took a's header (so b has posted its own); a finishes before it polled: a takes b's
    header then, and both ends succeed."""
    a, b = _pair()
    ra, rb = _rows(), _rows()
    a.post([1], _header(0))
    b.post([0], _header(5))
    assert not b.poll(0.0, rb)  # b took a's
    assert a.finish(ra) == [DONE]
    assert b.poll(0.0, rb) and b.finish(rb) == [DONE]
    assert ra[0, 1] == 6 and rb[0, 1] == 1


def test_an_end_that_withdraws_before_its_header_was_taken_fails_both_ends():
    """b took a's header, then gave up before a took b's: b withdraws, so a finds nothing
    to take and fails too, though its own header was taken."""
    a, b = _pair()
    ra, rb = _rows(), _rows()
    a.post([1], _header(0))
    b.post([0], _header(5))
    assert not b.poll(0.0, rb)
    assert b.finish(rb) == [TOOK_NOTHING]
    assert not a.poll(0.001, ra)
    assert a.finish(ra) == [POSTED_NOTHING]


def test_one_exchange_with_several_peers_reports_each_pair():
    a, b, c = _C.HostMailbox(0, 3, WORDS), _C.HostMailbox(1, 3, WORDS), _C.HostMailbox(2, 3, WORDS)
    for m, r in ((a, 0), (b, 1), (c, 2)):
        for other, s in ((a, 0), (b, 1), (c, 2)):
            if s != r:
                m.attach(s, other.name)
    ra, rb = np.zeros((2, WORDS), dtype=np.int64), _rows()
    a.post([1, 2], _header(0))
    b.post([0], _header(10))
    assert not a.poll(0.0, ra) and b.poll(0.0, rb)
    assert a.finish(ra) == [DONE, POSTED_NOTHING] and b.finish(rb) == [DONE]
    assert ra[0, 1] == 11 and (ra[1] == 0).all() and rb[0, 1] == 1
    rc = _rows()
    c.post([0], _header(20))  # a's header to c was withdrawn
    assert not c.poll(0.001, rc) and c.finish(rc) == [POSTED_NOTHING]


def test_misuse_raises():
    a, b = _pair()
    c = _C.HostMailbox(0, 3, WORDS)
    with pytest.raises(ReshardError, match="not one of this group"):
        c.attach(1, b.name)  # a segment of a 2-rank group
    with pytest.raises(ReshardError, match="cannot open"):
        c.attach(2, "/reshard_ext.no-such-segment")
    with pytest.raises(RuntimeError, match="not attached"):
        c.post([2], _header(0))
    with pytest.raises(RuntimeError, match="int64 row"):
        a.post([1], np.zeros(WORDS + 1, dtype=np.int64))
    a.post([1], _header(0))
    with pytest.raises(RuntimeError, match="still open"):
        a.post([1], _header(0))
    with pytest.raises(RuntimeError, match="rows must be"):
        a.poll(0.0, np.zeros((1, WORDS - 1), dtype=np.int64))
    assert a.finish(_rows()) == [POSTED_NOTHING]


def test_segments_of_killed_processes_are_removed_by_the_next_mailbox():
    import os
    import subprocess
    import sys

    code = "import os; from reshard_ext import _C; m = _C.HostMailbox(0, 2, 10); print(m.name, flush=True); os._exit(0)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    name = run.stdout.strip()
    assert name.startswith("/reshard_ext.") and os.path.exists("/dev/shm" + name)  # os._exit: no cleanup
    mine = _C.HostMailbox(0, 2, WORDS)
    assert not os.path.exists("/dev/shm" + name) and os.path.exists("/dev/shm" + mine.name)
    del mine


def test_a_forked_child_leaves_its_parents_segment():
    import os

    mine = _C.HostMailbox(0, 2, WORDS)
    pid = os.fork()
    if pid == 0:  # the child drops its copy of the mailbox, as its exit would
        del mine
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.path.exists("/dev/shm" + mine.name)


def test_a_row_of_another_kind_of_exchange_is_left_for_it():
    """b is already in its next kind of exchange (its outcome row) while a still waits for
    headers: a takes nothing, and b's row stays posted for a's exchange of that kind."""
    a, b = _pair()
    ra, rb = _rows(), _rows()
    b.post([0], _header(5, OTHER_KIND))
    a.post([1], _header(0))
    assert not a.poll(0.001, ra) and (ra == 0).all()
    assert a.finish(ra) == [POSTED_NOTHING]
    a.post([1], _header(1, OTHER_KIND))
    assert not a.poll(0.0, ra) and b.poll(0.0, rb) and a.poll(0.0, ra)
    assert a.finish(ra) == [DONE] and b.finish(rb) == [DONE]
    assert ra[0, 1] == 6 and rb[0, 1] == 2


@pytest.mark.parametrize("poster_first", [True, False], ids=["left_rank_posts_first", "late_rank_posts_first"])
def test_rows_of_an_execute_one_end_left_are_never_taken_as_the_others(poster_first: bool):
    """a left execute 7 (plan.abort() on one host: its alarm says so) and is already in
    execute 8's outcome while b still exchanges 7's: same kind of rows, other executes.
    Neither takes the other's (under load a took b's row of 7 as its row of 8 and b took
    a's row of 8, so b counted execute 8 and the ranks' numbers split). b then gives up on
    a (it left), withdraws, and meets a in 8."""
    a, b = _pair()
    ra, rb = _rows(), _rows()
    a.begin(7)
    a.raise_alarm(7, 0, "rank 0: rx.execute was aborted", True)
    a.end()
    a.begin(8)
    b.begin(7)
    first, second = ((a, 1, _header(8, OTHER_KIND)), (b, 0, _header(7, OTHER_KIND)))[:: 1 if poster_first else -1]
    first[0].post([first[1]], first[2])
    second[0].post([second[1]], second[2])
    for _ in range(3):
        assert not a.poll(0.0, ra) and not b.poll(0.0, rb)
    assert (ra == 0).all() and (rb == 0).all()
    assert b.finish(rb) == [POSTED_NOTHING]
    b.end()
    b.begin(8)
    b.post([0], _header(8 + 50, OTHER_KIND))
    assert not a.poll(0.0, ra)  # a takes b's row of 8; b has not taken a's yet
    assert b.poll(0.0, rb) and a.poll(0.0, ra)
    assert a.finish(ra) == [DONE] and b.finish(rb) == [DONE]
    assert ra[0, 1] == 8 + 50 + 1 and rb[0, 1] == 8 + 1


def test_alarms_are_read_by_token_whole():
    a, b = _pair()
    assert b.alarmed([0], 7) == [] and b.read_alarm(0, 7) is None
    a.begin(7)
    a.raise_alarm(7, 2, "rank 0: why\nand more", False)  # in its third call of execute 7 (a retry's)
    assert b.alarmed([0], 7) == [0] and b.alarmed([0], 8) == []
    assert b.read_alarm(0, 7) == (b"rank 0: why\nand more", False, 2)
    a.end()  # out of that execute: its alarm is no longer one to stop for, but still says why
    assert b.alarmed([0], 7) == [] and b.read_alarm(0, 7) is not None
    a.begin(9)  # a later execute: the earlier alarm stays readable
    assert b.read_alarm(0, 7) is not None and b.alarmed([0], 9) == []
    a.begin(7)  # the same number again (the earlier execute did not count): its old alarm is gone
    assert b.alarmed([0], 7) == [] and b.read_alarm(0, 7) is None
    a.raise_alarm(8, 0, "x" * 5000, True)  # cut to the mailbox's room; left: read even outside the execute
    text, left, attempt = b.read_alarm(0, 8)
    assert left and text == b"x" * 1000 and attempt == 0 and b.alarmed([0], 8) == [0]


def test_a_peer_whose_process_exited_is_gone():
    import os
    import subprocess
    import sys

    code = ("import os, sys; from reshard_ext import _C; m = _C.HostMailbox(1, 2, 10); print(m.name, flush=True); "
            "sys.stdin.readline(); os._exit(0)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=env)
    name = child.stdout.readline().strip()
    mine = _C.HostMailbox(0, 2, WORDS)
    mine.attach(1, name)
    assert mine.gone([1]) == []  # running
    child.kill()  # not reaped yet: a zombie reads as gone too
    import time

    for _ in range(100):
        if mine.gone([1]):
            break
        time.sleep(0.01)
    assert mine.gone([1]) == [1]
    child.wait()
    assert mine.gone([1]) == [1]


def test_a_peer_is_behind_while_it_is_in_an_earlier_attempt_of_the_execute():
    """behind(): a peer in the execute of a token at a lower attempt (the call the others
    gave up on); not once it is in the retry, in another execute, or in none."""
    a, b = _pair()
    token = 7
    assert b.behind([0], token, 1) == []  # in no execute
    a.begin(token, 0)
    assert b.behind([0], token, 1) == [0] and b.behind([0], token, 0) == []
    assert b.behind([0], token + 1, 1) == []  # another execute's token
    a.end()
    assert b.behind([0], token, 1) == []
    a.begin(token, 1)  # the retry: level with b's
    assert b.behind([0], token, 1) == [] and b.behind([0], token, 2) == [0]
