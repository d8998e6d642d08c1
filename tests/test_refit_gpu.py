"""GPU refits over NCCL: the same layout matrix as the CPU tests, bit for bit, through
the C++ NCCL transport and through torch.distributed point-to-point."""
import pytest
import torch

from _cases import run_case
from _dist import run_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs2 = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
needs4 = pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs")


@needs2
@pytest.mark.parametrize("backend", ["nccl", "torch"])
@pytest.mark.parametrize("case", ["two", "tp", "uneven_blocks", "casts"])
@pytest.mark.parametrize("max_batch_bytes", [None, 512])
def test_matrix_2gpu(case, backend, max_batch_bytes):
    run_ranks(2, run_case, case, "cuda", max_batch_bytes, backend, backend="nccl")


@needs4
@pytest.mark.parametrize("case", ["tp", "uneven_blocks", "meshes", "pp_experts", "placement", "casts"])
@pytest.mark.parametrize("max_batch_bytes", [None, 512])
def test_matrix_4gpu(case, max_batch_bytes):
    run_ranks(4, run_case, case, "cuda", max_batch_bytes, "nccl", backend="nccl")


def _with_direct(rank, world, case, direct_bytes):
    import reshard_ext.transports.cuda as cuda_transport

    saved = cuda_transport.DIRECT_BYTES
    cuda_transport.DIRECT_BYTES = direct_bytes
    try:
        return run_case(rank, world, case, "cuda", None, "nccl")
    finally:
        cuda_transport.DIRECT_BYTES = saved


@needs2
@pytest.mark.parametrize("case", ["two", "tp", "uneven_blocks", "casts"])
def test_direct_messages_2gpu(case):
    """Every op big enough to go straight from/into its tensor where contiguous."""
    run_ranks(2, _with_direct, case, 1, backend="nccl")
