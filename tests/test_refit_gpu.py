"""GPU refits: the same layout matrix as the CPU tests, bit for bit, through the C++ NCCL
transport, torch.distributed point-to-point and the NVSHMEM transport."""
import pytest
import torch
from _cases import run_case
from _dist import run_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs2 = pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
needs4 = pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs")


# Batching: None (defaults), "soft" (batches of about 512 bytes each way: many batches,
# the pipeline at work), "hard" (max_batch_bytes=4096 bounds each rank's staging).
BATCHING = [None, "soft", "hard"]


def _batched(rank, world, batching, case, backend="nccl", knobs=None):
    import reshard_ext as rx

    knobs = dict(knobs or {})
    if batching == "soft":
        knobs["batch_bytes"] = 512
    limit = 4096 if batching == "hard" else None
    return run_case(rank, world, case, "cuda", limit, backend, options=rx.Options(tuning=rx.Tuning(**knobs)))


@needs2
@pytest.mark.parametrize("backend", ["nccl", "torch", "nvshmem"])
@pytest.mark.parametrize("case", ["two", "tp", "uneven_blocks", "casts"])
@pytest.mark.parametrize("batching", BATCHING)
def test_matrix_2gpu(case, backend, batching):
    run_ranks(2, _batched, batching, case, backend, backend="nccl")


@needs4
@pytest.mark.parametrize("backend", ["nccl", "nvshmem"])
@pytest.mark.parametrize("case", ["tp", "uneven_blocks", "meshes", "pp_experts", "placement", "casts"])
@pytest.mark.parametrize("batching", BATCHING)
def test_matrix_4gpu(case, batching, backend):
    # ("tp", "soft", "nvshmem"): rank 3's slots take three senders' batches at offsets that shift with who
    # sends, so a sender must wait for the receiver's unpack of the slot's previous batch, not its own message.
    run_ranks(4, _batched, batching, case, backend, backend="nccl")


def _with_knobs(rank, world, knobs, case, max_batch_bytes):
    import reshard_ext as rx

    return run_case(rank, world, case, "cuda", max_batch_bytes, "nccl", options=rx.Options(tuning=rx.Tuning(**knobs)))


@needs2
@pytest.mark.parametrize("case", ["two", "tp", "uneven_blocks", "casts"])
def test_direct_messages_2gpu(case):
    """Every op big enough to go straight from/into its tensor where contiguous."""
    run_ranks(2, _with_knobs, {"direct_bytes": 1}, case, None, backend="nccl")


@needs2
@pytest.mark.parametrize("register", [True, False])
@pytest.mark.parametrize("case", ["two", "tp", "casts"])
@pytest.mark.parametrize("batching", [None, "soft"])
def test_registration_on_and_off_2gpu(case, batching, register):
    """Staging and direct messages registered with NCCL (the default: zero-copy
    intra-node path) and not (NCCL's FIFOs)."""
    run_ranks(2, _batched, batching, case, "nccl", {"direct_bytes": 1, "nccl_register": register}, backend="nccl")


@needs4
@pytest.mark.parametrize("case", ["meshes", "pp_experts"])
def test_unregistered_4gpu(case):
    run_ranks(4, _batched, "soft", case, "nccl", {"direct_bytes": 1, "nccl_register": False}, backend="nccl")


@needs2
@pytest.mark.parametrize("max_blocks", [1, 7])
def test_capped_kernel_grid_2gpu(max_blocks):
    """Pack/unpack/copy launches capped to a few blocks still move every element."""
    run_ranks(2, _batched, "soft", "tp", "nccl", {"max_blocks": max_blocks}, backend="nccl")


def _rebind_registered(rank, world, options, backend="nccl"):
    """Registered direct messages into a dst tensor that is then freed, its memory
    reused by another tensor, and a new dst bound: the refit must land in the new
    tensor only, and the old memory's new owner must stay untouched. (backend "direct":
    the sender maps the new tensor when the next execute hands it over.)"""
    from _cases import bits_equal

    import reshard_ext as rx
    from reshard_ext import Layout, Mesh, Replicate, Shard

    shape = (256, 4096)  # row shards -> whole tensor: one contiguous 2 MiB message each way
    sl = Layout(shape, torch.float32, Mesh([0, 1]), [Shard(0)])
    dl = Layout(shape, torch.float32, Mesh([0, 1]), [Replicate()])
    g = torch.randn(shape, generator=torch.Generator().manual_seed(11))
    src = {"w": (sl.local_part(g, rank).cuda(), sl)}
    old = torch.zeros(dl.local_shape(rank), device="cuda")
    p = rx.plan(src, {"w": (old, dl)}, options=options, backend=backend)
    rx.execute(p)
    torch.cuda.synchronize()
    ok = [bits_equal(old.cpu(), dl.local_part(g, rank))]
    new = torch.full(dl.local_shape(rank), float("nan"), device="cuda")
    p.rebind(dst={"w": (new, dl)})
    del old
    reuse = torch.full(dl.local_shape(rank), 7.0, device="cuda")  # likely the freed block
    src["w"][0].mul_(3)
    rx.execute(p)
    torch.cuda.synchronize()
    ok.append(bits_equal(new.cpu(), dl.local_part(g * 3, rank)))
    ok.append(bool((reuse == 7.0).all()))
    ok.append(p.num_ops)
    return ok


@needs2
def test_rebind_reregisters_2gpu():
    import reshard_ext as rx

    for ok in run_ranks(2, _rebind_registered, rx.Options(tuning=rx.Tuning(direct_bytes=1)), backend="nccl"):
        assert ok[:3] == [True, True, True] and tuple(ok[3][:2]) == (1, 1), ok


@needs2
def test_nvshmem_rebind_and_verify_2gpu():
    """NVSHMEM: a rebound destination receives the next refit (the symmetric staging and
    the peers' offsets stay); the traced pipeline moves the same bytes."""
    import reshard_ext as rx

    for ok in run_ranks(2, _rebind_registered, None, "nvshmem", backend="nccl"):
        assert ok[:3] == [True, True, True] and tuple(ok[3][:2]) == (1, 1), ok
    run_ranks(2, run_case, "tp", "cuda", 512, "nvshmem", rx.Options(trace=True), backend="nccl")


def _verified(rank, world, case, backend):
    import reshard_ext as rx

    def check(plan):
        for _ in range(3):  # several executes: the put/free counters carry across them
            rx.execute(plan, verify=True)
        rx.verify(plan)
        return plan.backend

    return run_case(rank, world, case, "cuda", 512, backend, None, check)


@needs2
@pytest.mark.parametrize("case", ["tp", "casts"])
def test_nvshmem_verify_2gpu(case):
    assert run_ranks(2, _verified, case, "nvshmem", backend="nccl") == ["nvshmem", "nvshmem"]


def _nvshmem_symmetric_staging(rank, world):
    def check(plan):
        _, slots, stride, _ = plan.transport._layout
        return slots, slots * stride, plan.staging_bytes

    return run_case(rank, world, "tp", "cuda", 4096, "nvshmem", None, check)


@needs2
def test_nvshmem_symmetric_staging_within_max_batch_bytes_2gpu():
    """Both slots of NVSHMEM's symmetric staging count against max_batch_bytes (rx.plan plans
    for the transport's STAGING_SLOTS), as every transport's staging does."""
    for slots, symmetric, staging in run_ranks(2, _nvshmem_symmetric_staging, backend="nccl"):
        assert slots == 2, slots  # several batches: the bound is at work
        assert symmetric == staging and staging <= 4096, (symmetric, staging)
