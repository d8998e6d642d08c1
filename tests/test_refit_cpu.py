"""CPU refits over real gloo process groups: the layout matrix, bit for bit."""
import pytest

from _cases import CASES, run_case
from _dist import run_ranks


@pytest.mark.parametrize("case", sorted(CASES))  # "two" included: any world >= 2
@pytest.mark.parametrize("max_batch_bytes", [None, 256])
def test_matrix_world4(case, max_batch_bytes):
    run_ranks(4, run_case, case, "cpu", max_batch_bytes)


def test_tp8():
    run_ranks(8, run_case, "tp", "cpu", None)


@pytest.mark.parametrize("case", ["casts", "two", "tp"])
def test_world2_backend_cpu_explicit(case):
    run_ranks(2, run_case, case, "cpu", None, "cpu")
