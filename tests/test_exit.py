"""Processes exit cleanly after a refit and a caught ReshardError (issue: SIGABRT,
"terminate called without an active exception", on one rank at exit in 3 of 21 runs of
DTensor swap -> caught mismatched-names error -> destroy_process_group). Each repetition
is a fresh 4-process group, since the failure is in process teardown."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from _dist import free_port

WORLD = 4
REPEATS = 6
SCRIPT = textwrap.dedent("""
    import datetime, sys
    import torch, torch.distributed as dist
    from torch import nn

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=120))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    import reshard_ext as rx

    mesh = init_device_mesh("cpu", (2, 2))

    class M(nn.Module):
        def __init__(self, placements, names):
            super().__init__()
            for n in names:
                self.register_parameter(n, nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, placements)))

    a, b = M([Shard(0), Shard(1)], ("w", "b")), M([Replicate(), Shard(1)], ("w", "b"))
    for _ in range(3):
        rx.swap_model_weights(a, b)
    ok = torch.equal(a.w.full_tensor(), b.w.full_tensor())
    try:
        rx.swap_model_weights(a, M([Replicate(), Shard(1)], ("w", "zzz")))
        raised = False
    except rx.ReshardError:
        raised = True
    dist.destroy_process_group()
    print(f"rank {rank}: refit {'ok' if ok else 'WRONG'}, error {'raised' if raised else 'MISSING'}")
""")


@pytest.mark.parametrize("repeat", range(REPEATS))
def test_clean_exit_after_a_caught_error(tmp_path, repeat: int) -> None:
    script = tmp_path / "exit_after_error.py"
    script.write_text(SCRIPT)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(WORLD)]
    outs = [p.communicate(timeout=300) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{err[-3000:]}"
        assert "terminate called" not in err, err[-3000:]
        assert f"rank {rank}: refit ok, error raised" in out, out + err[-3000:]


REINIT = textwrap.dedent("""
    import datetime, sys
    import torch, torch.distributed as dist
    import reshard_ext as rx
    from reshard_ext import Layout, Mesh, Shard

    rank, ports = int(sys.argv[1]), sys.argv[2].split(",")
    torch.set_num_threads(1)
    for port in ports:  # a group, destroyed, then made again
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        src_l = Layout((8, 4), torch.float32, Mesh([0, 1]), [Shard(0)])
        dst_l = Layout((8, 4), torch.float32, Mesh([0, 1]), [Shard(1)])
        g = torch.arange(32.0).view(8, 4)
        out = torch.zeros(dst_l.local_shape(rank))
        rx.execute(rx.plan({"w": (src_l.local_part(g, rank), src_l)}, {"w": (out, dst_l)}))
        assert torch.equal(out, dst_l.local_part(g, rank))
        dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
""")


def test_no_shared_memory_left_after_a_group_made_again(tmp_path) -> None:
    """Each channel's mailbox and rings are removed at exit, those of a destroyed group too."""
    script = tmp_path / "reinit.py"
    script.write_text(REINIT)
    ports = f"{free_port()},{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), ports], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    pids = {p.pid for p in procs}
    outs = [p.communicate(timeout=300) for p in procs]
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {rank}: done" in out, err[-3000:]
    left = [n for n in os.listdir("/dev/shm") if n.startswith("reshard_ext.") and int(n.split(".")[2]) in pids]
    assert left == [], left
