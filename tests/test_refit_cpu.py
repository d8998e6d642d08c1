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


def _with_direct_messages(rank, world, case, direct_bytes):
    from reshard_ext.transports.cpu import CpuTransport

    saved = CpuTransport.direct_bytes
    CpuTransport.direct_bytes = direct_bytes
    try:
        return run_case(rank, world, case, "cpu", None)
    finally:
        CpuTransport.direct_bytes = saved


@pytest.mark.parametrize("case", ["tp", "casts", "meshes", "pp_experts"])
@pytest.mark.parametrize("direct_bytes", [1, 64])
def test_direct_messages(case, direct_bytes):
    """Ops sent straight from / received straight into tensors (no staging) where
    contiguous, staged otherwise: same bits."""
    run_ranks(4, _with_direct_messages, case, direct_bytes)
