"""The same-rank box copy of a whole all-local refit in one launch, against a D2D copy of
the same bytes (one GPU): rank 0's boxes of Llama3-8B TP1->TP2 (8.03 GB of bf16; the
column-parallel weights and the embeddings are contiguous halves, the row-parallel ones
strided halves of 4 KiB and 14 KiB rows, the gated MLP's two halves two runs).

Rows: the kernel with the table's own choice of warps per tile, then with every choice
forced (`warp_shift`, rx_tile_warp_shift in csrc/kernels/api.h), then with other tile
sizes; ratios are D2D time / kernel time (1.00 = the D2D copy's rate). `--alternatives`
adds the routes without the kernel: torch's copy per box (a cudaMemcpy per contiguous
box, torch's strided kernel otherwise).

    python benchmarks/local_copy_bench.py [--tiles 8K,256K] [--alternatives] [--iters 15]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from _common import cuda_time, d2d_time, parse_size

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reshard_ext import _C  # noqa: E402
from tests._boxes import table  # noqa: E402

HIDDEN, FFN, VOCAB, LAYERS, QKV = 4096, 14336, 128256, 32, 6144
BF16 = int(_C.DType.bfloat16)


def llama_boxes() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(src view, dst view) per box of rank 0; the full sources stay referenced by the views."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []

    def weight(rows: int, cols: int, split: str) -> None:
        w = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda").normal_()
        if split == "rows":  # column-parallel: the first half of the rows
            d = torch.empty(rows // 2, cols, dtype=torch.bfloat16, device="cuda")
            out.append((w[: rows // 2], d))
        elif split == "gated":  # [gate; up]: the first half of each
            d = torch.empty(rows // 2, cols, dtype=torch.bfloat16, device="cuda")
            q = rows // 4
            out.extend([(w[:q], d[:q]), (w[2 * q:3 * q], d[q:])])
        elif split == "cols":  # row-parallel: the first half of every row
            out.append((w[:, : cols // 2], torch.empty(rows, cols // 2, dtype=torch.bfloat16, device="cuda")))
        else:  # replicated
            out.append((w, torch.empty_like(w)))

    weight(VOCAB, HIDDEN, "rows")
    for _ in range(LAYERS):
        weight(QKV, HIDDEN, "rows")
        weight(HIDDEN, HIDDEN, "cols")
        weight(2 * FFN, HIDDEN, "gated")
        weight(HIDDEN, FFN, "cols")
        weight(1, HIDDEN, "all")
        weight(1, HIDDEN, "all")
    weight(1, HIDDEN, "all")
    weight(VOCAB, HIDDEN, "rows")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiles", default="8K,256K", help="other tile sizes to time (the default is the planner's)")
    p.add_argument("--alternatives", action="store_true", help="also time torch's copy per box")
    p.add_argument("--iters", type=int, default=15)
    args = p.parse_args()
    if not torch.cuda.is_available() or not hasattr(_C, "DeviceBoxTable"):
        sys.exit("needs a GPU and a CUDA build of reshard_ext")
    boxes = llama_boxes()
    stream = torch.cuda.current_stream().cuda_stream
    rows = [(s.data_ptr(), d.data_ptr(), list(s.shape), list(s.stride()), list(d.stride()), BF16, BF16)
            for s, d in boxes]
    total = sum(s.numel() * 2 for s, _ in boxes)
    d2d = d2d_time(total, args.iters)
    print(f"# {torch.cuda.get_device_name()}: {total / 1e9:.2f} GB in {len(boxes)} boxes; D2D {d2d * 1e3:.3f} ms")

    keep = []

    def kernel(tile_bytes: int):  # noqa: ANN202 (a _C.DeviceBoxTable: CUDA builds only)
        t = _C.DeviceBoxTable(table(rows), tile_bytes)
        mem = torch.empty(t.nbytes, dtype=torch.uint8, device="cuda")
        t.upload(mem.data_ptr(), stream)
        keep.append(mem)
        return t

    def line(name: str, seconds: float) -> None:
        print(f"{name:34s} {seconds * 1e3:8.3f} ms  {d2d / seconds:5.3f} of D2D")

    def timed(tbl: object, shift: int = -1) -> float:
        return cuda_time(lambda: tbl.launch(stream, 0, warp_shift=shift), args.iters)  # type: ignore[attr-defined]

    t = kernel(0)
    line(f"kernel ({t.num_tiles} tiles, {1 << t.warp_shift} warps each)", timed(t))
    for shift in range(6):
        line(f"kernel, {1 << shift} warps per tile", timed(t, shift))
    for size in args.tiles.split(","):
        other = kernel(parse_size(size))
        line(f"kernel, {size} tiles ({1 << other.warp_shift} warps each)", timed(other))
    for _, d in boxes:
        d.zero_()
    t.launch(stream)
    assert all(torch.equal(s, d) for s, d in boxes), "the kernel's copy differs from the sources"
    if args.alternatives:
        line("torch copy_ per box", cuda_time(lambda: [d.copy_(s) for s, d in boxes], max(3, args.iters // 3)))


if __name__ == "__main__":
    main()
