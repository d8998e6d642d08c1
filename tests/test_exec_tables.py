"""ExecTables pieces the transports rely on, checked without a process group."""
import numpy as np
import torch

import reshard_ext as rx
from reshard_ext import Layout, Mesh, Replicate, _C
from reshard_ext.layout import code_of, dtype_of

from _boxes import BOX


def _boxes(blob: bytes) -> list[bytes]:
    """One bytes record per rx_box (comparable for equality)."""
    assert len(blob) % BOX.itemsize == 0
    return [blob[i : i + BOX.itemsize] for i in range(0, len(blob), BOX.itemsize)]


def _nbytes(record: bytes) -> int:
    box = np.frombuffer(record, dtype=BOX)[0]
    n = torch.empty((), dtype=dtype_of(int(box["dst_dtype"]))).element_size()
    return n * int(np.prod(box["shape"][: int(box["ndim"])]))


def test_copies_split_keeps_order_and_balances_bytes():
    # 40 tensors of mixed sizes, all copied on rank 0 (src and dst both live there).
    sizes = [(i % 7 + 1) * 1000 for i in range(40)]
    mesh = Mesh([0])
    layouts = {f"t{i}": Layout((n,), torch.float32, mesh, [Replicate()]) for i, n in enumerate(sizes)}
    rp = rx.local_plan(layouts, layouts, rank=0)
    tables = _C.ExecTables(rp._c)
    src = {n: torch.randn(s) for n, s in zip(layouts, sizes)}
    dst = {n: torch.empty(s) for n, s in zip(layouts, sizes)}
    names = sorted(layouts)  # the planner's table order

    def refs(tensors, used):
        return [(tensors[names[i]].data_ptr(), list(tensors[names[i]].stride()), code_of(torch.float32)) for i in used]

    staging = torch.empty(16, dtype=torch.uint8)  # unused: nothing travels
    tables.bind(refs(src, tables.src_used), refs(dst, tables.dst_used), [staging.data_ptr()], [staging.data_ptr()])
    whole = _boxes(tables.copy_boxes())
    assert len(whole) == 40
    for parts in (1, 3, 7, 64):
        split = [_boxes(b) for b in tables.copy_boxes_split(parts)]
        assert len(split) == parts
        assert [b for part in split for b in part] == whole  # every box once, in order
        per = [sum(map(_nbytes, part)) for part in split]
        biggest = max(map(_nbytes, whole))
        if parts <= len(whole):
            # a batch's share each (tapered: half shares at the ends from 3 parts on),
            # off by at most one box
            share = [1.0] * parts if parts < 3 else [0.5] + [1.0] * (parts - 2) + [0.5]
            want = [sum(per) * w / sum(share) for w in share]
            assert all(abs(p - w) <= biggest for p, w in zip(per, want)), (per, want)
