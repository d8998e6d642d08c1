"""The engine worker's side of a refit, for an engine launched as its own job.

An RL framework puts these plain functions where the engine runs its workers' code:
- vLLM: a worker extension, ``LLM(..., worker_extension_cls="engine_worker.RefitExtension")``,
  whose methods every worker runs through ``llm.collective_rpc("rx_join", args=...)`` and
  ``llm.collective_rpc("rx_refit")``;
- SGLang: the same calls from a hook on each TP worker's model runner (``model_runner.model``),
  in place of ``update_weights_from_distributed``.
The trainer ranks call `join`, `trainer_plan` once and `trainer_refit` every step:

    trainer rank t (its own torchrun)             engine worker e (vLLM / SGLang)
    group = join(addr, T + E, t)                  group = join(addr, T + E, T + e)
    plan = trainer_plan(model, group)             refit = EngineRefit(engine_model, group, checkpoint)
    every step: trainer_refit(plan)               every step: refit.step()

`join` is the one place that calls ``rx.connect``. Each engine rank receives only the
slices its parameters hold (traced once from the engine's own load_weights).

    python examples/engine_worker.py    # 2 trainer + 2 engine processes, two separate worlds, CPU
"""
from __future__ import annotations

import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import reshard_ext as rx


def join(address: str, world_size: int, rank: int, timeout: float = 120.0) -> Any:
    """The refit group over the trainer's and the engine's ranks (each job keeps its own world)."""
    return rx.connect(address, world_size, rank, timeout=timeout)


# --- engine side -----------------------------------------------------------------------


class EngineRefit:
    """One engine worker's refits: traces the engine's loader and plans once, then every
    `step` receives this rank's slices into the engine's parameters. `post_load`: the
    engine's post-load step, for quantized weights (vLLM: process_weights_after_loading)."""

    def __init__(self, model: torch.nn.Module, group: Any, checkpoint: str,
                 post_load: Callable[[], None] | None = None):
        self.entries = rx.adapters.engine.entries(model, group=group, weights=checkpoint)
        self.plan = rx.plan(src=None, dst=self.entries, group=group)
        self.post_load = post_load

    def step(self) -> None:
        rx.execute(self.plan)
        self.entries.finish()  # tensors on the safe path (if any) through the engine's own loader
        if self.post_load is not None:
            self.post_load()


class RefitExtension:
    """A vLLM worker extension (``worker_extension_cls``): its methods run on every worker."""

    def rx_join(self, address: str, trainer_world: int, checkpoint: str) -> None:
        engine_rank, engine_world = dist.get_rank(), dist.get_world_size()  # the engine's own world
        group = join(address, trainer_world + engine_world, trainer_world + engine_rank)
        self.rx_refit_state = EngineRefit(self.get_model(), group, checkpoint)  # type: ignore[attr-defined]

    def rx_refit(self) -> None:
        self.rx_refit_state.step()


# --- trainer side ----------------------------------------------------------------------


def trainer_plan(model: torch.nn.Module, group: Any) -> Any:
    """The trainer's plan: its model described under Hugging Face names (an FSDP2 or
    transformers model as it is; a Megatron-Core model through adapters.megatron_hf)."""
    return rx.plan(src=rx.adapters.describe(model, rx.adapters.pick(model), side="src", group=group), dst=None,
                   group=group)


def trainer_refit(plan: Any) -> None:
    rx.execute(plan)


# --- a CPU run of both jobs --------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp2_to_engine import ENGINES, TRAINERS, engine_model, hf_model  # noqa: E402  (the same two models)


def trainer_job(rank: int, port: int, address: str, checkpoint: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TRAINERS)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = hf_model()
    if rank == 0:
        model.save_pretrained(checkpoint)
    mesh = init_device_mesh("cpu", (TRAINERS,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    group = join(address, TRAINERS + ENGINES, rank)
    plan = trainer_plan(model, group)
    for step in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().mul_(0.5).add_(step)
        trainer_refit(plan)
        rx.verify(plan)
    group.close()


def engine_job(rank: int, port: int, address: str, checkpoint: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ENGINES)
    group = join(address, TRAINERS + ENGINES, TRAINERS + rank)  # returns once the trainer saved the checkpoint
    engine = engine_model(rank, checkpoint)
    refit = EngineRefit(engine, group, checkpoint)
    for _ in range(3):
        refit.step()
        rx.verify(refit.plan)
    if rank == 0:
        print(f"3 refits verified; engine rank 0 received {refit.plan.bytes_received} bytes per refit")
    group.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    address = f"127.0.0.1:{_free_port()}"  # where refit rank 0 hosts the group's store
    trainer_port, engine_port = _free_port(), _free_port()  # each job's own world
    with tempfile.TemporaryDirectory() as checkpoint:
        ctx = mp.get_context("spawn")
        jobs = [ctx.Process(target=trainer_job, args=(r, trainer_port, address, checkpoint)) for r in range(TRAINERS)]
        jobs += [ctx.Process(target=engine_job, args=(r, engine_port, address, checkpoint)) for r in range(ENGINES)]
        for job in jobs:
            job.start()
        for job in jobs:
            job.join()
        failed = [i for i, job in enumerate(jobs) if job.exitcode]
        if failed:
            raise SystemExit(f"processes {failed} failed")
