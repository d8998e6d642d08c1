"""reshard_ext: move model weights between parallel layouts (training -> inference refit)."""
from __future__ import annotations

from typing import Any

import torch  # noqa: F401  (loads torch's CUDA/NCCL libraries before the extension)

from . import _C, adapters, merged, relay
from .errors import InternalError, ReshardError
from .execution import Plan, execute, plan, verify
from .layout import Layout, Mesh, Replicate, Shard
from .mxfp8 import MXFP8
from .options import Options
from .planning import RankPlan, TransferOp, local_plan
from .swap import clear_caches, prepare_swap_model_weights, swap_model_weights
from .transforms import Rewrite, Transform

__version__: str = str(_C._build_info["version"])


def build_info() -> dict[str, Any]:
    """What the compiled extension contains: version, CUDA kernels (and their arch and
    runtime linkage), the NCCL transport (and the nccl.h it was built against), the NVSHMEM
    transport and the libnvshmem_host it loaded ('' until a plan or `info` loads one)."""
    from . import _nvshmem

    return dict(_C._build_info, nvshmem_library=_nvshmem.loaded_library())


__all__ = [
    "Layout", "Mesh", "Replicate", "Shard", "ReshardError", "InternalError", "Options",
    "Rewrite", "Transform", "build_info", "plan", "execute", "verify", "Plan", "local_plan", "RankPlan", "TransferOp",
    "MXFP8",
    "adapters", "merged", "relay", "swap_model_weights", "prepare_swap_model_weights", "clear_caches", "__version__",
]
