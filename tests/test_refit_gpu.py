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


def _with_knobs(rank, world, case, max_batch_bytes, **knobs):
    """run_case with module-level transport knobs (DIRECT_BYTES, REGISTER, MAX_BLOCKS)
    set for this call only."""
    import os

    import reshard_ext.transports.cuda as cuda_transport

    if knobs.get("REGISTER"):
        os.environ["NCCL_LEGACY_CUDA_REGISTER"] = "1"  # torch's cudaMalloc'd tensors and staging
    saved = {k: getattr(cuda_transport, k) for k in knobs}
    for k, v in knobs.items():
        setattr(cuda_transport, k, v)
    try:
        return run_case(rank, world, case, "cuda", max_batch_bytes, "nccl")
    finally:
        for k, v in saved.items():
            setattr(cuda_transport, k, v)


@needs2
@pytest.mark.parametrize("case", ["two", "tp", "uneven_blocks", "casts"])
def test_direct_messages_2gpu(case):
    """Every op big enough to go straight from/into its tensor where contiguous."""
    run_ranks(2, _with_knobs, case, None, DIRECT_BYTES=1, backend="nccl")


@needs2
@pytest.mark.parametrize("case", ["two", "tp", "casts"])
@pytest.mark.parametrize("max_batch_bytes", [None, 512])
def test_registered_buffers_2gpu(case, max_batch_bytes):
    """Staging and direct messages registered with NCCL (zero-copy intra-node path)."""
    run_ranks(2, _with_knobs, case, max_batch_bytes, DIRECT_BYTES=1, REGISTER=True, backend="nccl")


@needs4
@pytest.mark.parametrize("case", ["meshes", "pp_experts"])
def test_registered_buffers_4gpu(case):
    run_ranks(4, _with_knobs, case, 512, DIRECT_BYTES=1, REGISTER=True, backend="nccl")


@needs2
@pytest.mark.parametrize("max_blocks", [1, 7])
def test_capped_kernel_grid_2gpu(max_blocks):
    """Pack/unpack/copy launches capped to a few blocks still move every element."""
    run_ranks(2, _with_knobs, "tp", 512, MAX_BLOCKS=max_blocks, backend="nccl")
