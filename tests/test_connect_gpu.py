"""rx.connect on GPUs: a trainer job and an engine job, each with its own NCCL world (or
the engine with none), refit through the connected group over every CUDA transport,
bit for bit. Process i of the whole set uses CUDA device i."""
import pytest
import torch
from _cases import run_case
from _dist import free_port
from _jobs import run_jobs

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs2 = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
needs4 = pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs")
pytestmark = pytest.mark.gpu

BACKENDS = ["nccl", "direct", "torch", "nvshmem"]


def _refit(job, local, sizes, port, cases, backend):
    import reshard_ext as rx

    rank, world = sum(sizes[:job]) + local, sum(sizes)
    with rx.connect(f"127.0.0.1:{port}", world, rank, timeout=120) as group:
        routes = []
        for case in cases:
            run_case(rank, world, case, "cuda", None, backend, group=group,
                     inspect=lambda p: routes.append((p.backend, p.routes)))
        return routes


def _check(got, backend):
    for routes in got:
        for chosen, summary in routes:
            assert chosen == backend, (chosen, summary)
            if backend == "direct":  # every pair of one host maps its peers: none falls back to NCCL
                assert "NCCL with ranks [" not in summary and "point-to-point with ranks [" not in summary, summary


@needs2
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_gpu_trainer_one_gpu_engine(backend):
    got = run_jobs(((1, "nccl"), (1, "nccl")), _refit, free_port(), ("two", "tp", "casts"), backend)
    _check(got, backend)


@needs4
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("engine", ["nccl", None], ids=["engine-world", "engine-without-world"])
def test_two_gpu_trainer_two_gpu_engine(backend, engine):
    got = run_jobs(((2, "nccl"), (2, engine)), _refit, free_port(), ("tp", "meshes", "casts"), backend)
    _check(got, backend)
