"""reshard_ext: move model weights between parallel layouts (training -> inference refit)."""
from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch  # noqa: F401  (loads torch's CUDA/NCCL libraries before the extension)

try:
    from . import _C
except ImportError:
    if importlib.util.find_spec(f"{__name__}._C") is not None:
        raise  # built, but it does not load: the loader's message says why
    # The bare `from . import _C` would say "partially initialized module ... circular import".
    raise ImportError(
        f"reshard_ext's compiled extension _C is not built: Python imported the uncompiled sources in "
        f"{os.path.dirname(__file__)}. Install the package (python -m pip install .) and import it from "
        "another folder (these sources shadow an installed copy), or build it in place for development "
        "(scripts/dev_build.sh OFF)") from None

from . import adapters, merged, relay, views
from .connect import ConnectedGroup, connect
from .errors import InternalError, ReshardError
from .execution import Plan, execute, plan, verify
from .fp8block import FP8Block
from .layout import Layout, Mesh, Replicate, Shard
from .mxfp8 import MXFP8
from .nvfp4 import NVFP4
from .options import Options, Tuning
from .planning import RankPlan, TransferOp, local_plan
from .swap import clear_caches, prepare_swap_model_weights, swap_model_weights
from .transforms import Rewrite, Transform

__version__: str = str(_C._build_info["version"])


def build_info() -> dict[str, Any]:
    """What the compiled extension contains: version, CUDA kernels (and their arch and
    runtime linkage, or why they were not built: `cuda_skipped`), the NCCL transport (and
    the nccl.h it was built against), the NVSHMEM transport and the libnvshmem_host it
    loaded ('' until a plan or `info` loads one), and `transports`: every transport
    compiled in (`python -m reshard_ext info` says which ones this machine can run)."""
    from .transports import nvshmem_lib

    info = dict(_C._build_info, nvshmem_library=nvshmem_lib.loaded_library())
    info.setdefault("cuda_skipped", "" if info["cuda"] else "built without CUDA")
    cuda = ["direct", "torch"] if info["cuda"] else []
    info["transports"] = ["cpu", *cuda, *(["nccl"] if info["nccl"] else []), *(["nvshmem"] if info["nvshmem"] else [])]
    return info


__all__ = [
    "Layout", "Mesh", "Replicate", "Shard", "ReshardError", "InternalError", "Options", "Tuning",
    "Rewrite", "Transform", "build_info", "plan", "execute", "verify", "Plan", "local_plan", "RankPlan", "TransferOp",
    "MXFP8", "FP8Block", "NVFP4", "connect", "ConnectedGroup",
    "adapters", "merged", "relay", "views", "swap_model_weights", "prepare_swap_model_weights", "clear_caches",
    "__version__",
]


def __dir__() -> list[str]:
    """The public names (tab completion, help()), not the modules and names used to build them."""
    return sorted(__all__)
