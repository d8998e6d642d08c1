"""GPU refit benchmark (torchrun, one process per GPU, NCCL).

Per rank: the bytes that must cross the links, time, GB/s and the ratio to the link's
ceiling measured in the same run (the faster of an NCCL send/recv of exactly the same
byte counts between the same peers, no pack/unpack, and copy-engine peer copies of the
same bytes, every rank at once), the same-rank bytes and their ratio to a
device-to-device copy, the HBM bytes the GPU touches per byte delivered (from the plan,
per backend), and the same refit done the way Megatron-Core does it (one
batch_isend_irecv op per slice, slices made contiguous in Python) as a baseline.

    torchrun --nproc-per-node 2 benchmarks/refit_bench.py --case tp2-tp1 --backend nccl,direct,nvshmem [--verify]
    torchrun --nproc-per-node 4 benchmarks/refit_bench.py --case relay-1to3 [--relay-stages G]  (relay off / on)
Cases (world = GPUs): see CASES below. Times are medians of --iters after warm-up.
--backend takes one backend or a comma list (an A/B in one run, same tensors); --variants
adds rx.Options / rx.Tuning variants to that A/B (e.g. the direct transport's knobs).
--verify adds a column: the same refit with rx.execute(plan, verify=True) (digests in
the kernels, their exchange and the agreement included), timed in the same run, and its
cost relative to the plain refit.
"""
from __future__ import annotations

import argparse
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

# Lets NCCL register torch's cudaMalloc'd memory (the registered ceiling below, and the
# transport under RESHARD_EXT_NCCL_REGISTER=1); unregistered transfers ignore it.
os.environ.setdefault("NCCL_LEGACY_CUDA_REGISTER", "1")

from _common import cuda_time as _time
from _common import d2d_time, hbm_per_byte, nccl_ceiling, peer_copy_ceiling

import reshard_ext as rx  # noqa: E402
from reshard_ext.execution import BACKENDS  # noqa: E402
from reshard_ext.synthetic import LLAMA3_8B, ModelShape, Parallel, model_layouts, total_bytes

MOE_SMALL = ModelShape(layers=48, hidden=2048, ffn=6144, heads=32, kv_heads=4, vocab=151936,
                       experts=64, moe_ffn=384, first_dense_layers=0)

# name -> (model, src parallel, dst parallel, min world), the collocated cases scaled to
# the world (DP fills the GPUs: TP2->TP1 on 4 GPUs is TP2*DP2 -> TP1*DP4)
def _cases(w: int) -> dict:
    h = max(1, w // 2)
    return {
        "tp2-tp1": (LLAMA3_8B, Parallel(tp=2, dp=h), Parallel(tp=1, dp=2 * h), 2),       # collocated
        "tp1-tp2": (LLAMA3_8B, Parallel(tp=1, dp=2 * h), Parallel(tp=2, dp=h), 2),       # collocated
        "noncolo-tp1-tp1": (LLAMA3_8B, Parallel(tp=1), Parallel(tp=1, offset=1), 2),
        "noncolo-tp2-tp2dp": (LLAMA3_8B, Parallel(tp=2), Parallel(tp=2, dp=1, offset=2), 4),
        "moe-ep2-ep1": (MOE_SMALL, Parallel(dp=2 * h, ep=2), Parallel(dp=2 * h, ep=1), 2),
    }


CASES = _cases(2)


def _megatron_style(src: dict, dst: dict, src_l: dict, dst_l: dict, rank: int):
    """One P2P op per slice, contiguous copies in Python, like core.resharding's NCCL path."""
    p = rx.local_plan(src_l, dst_l, rank)
    def run() -> None:
        ops, landings = [], []
        for op in p.sends:
            if op.peer == rank:
                continue
            ops.append(dist.P2POp(dist.isend, src[op.name][0][op.my_box].contiguous(), op.peer))
        for op in p.recvs:
            t = dst[op.name][0]
            if op.peer == rank:
                t[op.my_box].copy_(src[op.name][0][op.peer_box])
                continue
            buf = torch.empty(t[op.my_box].shape, dtype=src_l[op.name].dtype, device=t.device)
            ops.append(dist.P2POp(dist.irecv, buf, op.peer))
            landings.append((t, op.my_box, buf))
        if ops:
            for r in dist.batch_isend_irecv(ops):
                r.wait()
        for t, box, buf in landings:
            t[box].copy_(buf)
    return run


def _mxfp8_refit(args: argparse.Namespace, src: dict, src_l: dict, dst_l: dict, rank: int,
                 options: rx.Options | None = None) -> tuple[int, int, float, float, str, str]:
    """The same refit with the 2-D linear weights landing as quantized buffers: MXFP8, blockwise
    FP8 (--codec fp8block) or NVFP4 (--codec nvfp4); `options`: one --variants entry's."""
    from reshard_ext.codecs.fp8block import scale_shape
    from reshard_ext.codecs.nvfp4 import scale_numel as nv_scale_numel
    from reshard_ext.mxfp8 import scale_numel

    def buffers_of(local: tuple) -> tuple:
        if args.codec == "nvfp4":  # packed E2M1 data, E4M3 block scales, the per-tensor scale
            return (torch.empty(local[:-1] + (local[-1] // 2,), dtype=torch.uint8, device="cuda"),
                    torch.empty(nv_scale_numel(local, args.scale_layout), dtype=torch.uint8, device="cuda"),
                    torch.empty(1, dtype=torch.float32, device="cuda"))
        data = torch.empty(local, dtype=torch.float8_e4m3fn, device="cuda")
        if args.codec == "fp8block":
            return data, torch.empty(scale_shape(tuple(local)), dtype=torch.float32, device="cuda")
        return data, torch.empty(scale_numel(local, args.scale_layout), dtype=torch.uint8, device="cuda")

    dst, names = {}, []
    for n, l in dst_l.items():
        if rank not in l.mesh:
            continue
        local = l.local_shape(rank)
        if ".linear_" in n and n.endswith("weight") and len(local) == 2 and l.shape[-1] % 32 == 0:
            dst[n] = (buffers_of(local), l)
            names.append(n)
        else:
            dst[n] = (torch.empty(local, device="cuda", dtype=l.dtype), l)
    # every rank must name the same converted tensors: the rule above depends on the name
    # and global shape only, so gather the union
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, names)
    converted = sorted({n for part in every for n in part})
    transform: Any
    if args.codec == "fp8block":
        transform = rx.FP8Block(params=converted, where=args.mxfp8)
    elif args.codec == "nvfp4":
        transform = rx.NVFP4(params=converted, scale_layout=args.scale_layout, where=args.mxfp8)
    else:
        transform = rx.MXFP8(params=converted, scale_layout=args.scale_layout, where=args.mxfp8)
    plan = rx.plan(src, dst, transform=transform, max_batch_bytes=(args.max_batch_mb << 20) or None,
                   backend=args.backend.split(",")[0], options=options)
    # BF16 bytes this rank sends of the converted tensors alone (the rest travels as is)
    chosen = set(converted)
    bf16_conv = sum(op.nbytes for op in rx.local_plan(src_l, dst_l, rank).sends
                    if op.peer != rank and op.name in chosen)
    t_verify = _time(lambda: rx.execute(plan, verify=True), args.iters) if args.verify else 0.0
    t = _time(lambda: rx.execute(plan), args.iters)
    return plan.bytes_sent, bf16_conv, t, t_verify, plan.routes, _timeline(args, plan)


def _timeline(args: argparse.Namespace, plan: Any) -> str:
    """One execute's CUDA-event timeline of `plan` (--timeline; with --verify a verified one's too)."""
    if not args.trace or not hasattr(plan.transport, "last_timeline"):
        return ""
    plan.transport.trace = True
    rx.execute(plan)
    text = plan.transport.last_timeline
    if args.verify:
        rx.execute(plan, verify=True)
        text += "\n   verify=True: " + plan.transport.last_timeline
    plan.transport.trace = False
    return text


def _options(variant: str) -> rx.Options:
    """rx.Options from 'field=value,...' of rx.Options and rx.Tuning fields (true/false or 1/0 for
    flags, integers with K/M/G)."""
    kw: dict = {}
    for item in filter(None, variant.split(",")):
        name, value = item.split("=", 1)
        low = value.strip().lower()
        if low in ("true", "false"):
            kw[name.strip()] = low == "true"
        else:
            scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(low[-1:], 1)
            kw[name.strip()] = int(low[:-1] if scale > 1 else low) * scale
    for cls in (rx.Options, rx.Tuning):  # 0 / 1 for a flag too
        for name, field in cls.__dataclass_fields__.items():
            if name in kw and "bool" in str(field.type) and kw[name] in (0, 1):
                kw[name] = bool(kw[name])
    tuned = {name: kw.pop(name) for name in list(kw) if name in rx.Tuning.__dataclass_fields__}
    return rx.Options(**kw, tuning=rx.Tuning(**tuned) if tuned else None)


def _pieces(layouts: dict, rank: int, random: bool = False) -> dict:
    """{name: (this rank's piece on the GPU, layout)}: random values, or uninitialised."""
    out = {}
    for name, layout in layouts.items():
        if rank in layout.mesh:
            shape = layout.local_shape(rank)
            t = torch.randn(shape, device="cuda").to(layout.dtype) if random else torch.empty(
                shape, device="cuda", dtype=layout.dtype)
            out[name] = (t, layout)
    return out


def case_tensors(case: str, rank: int, world: int) -> tuple[dict, dict]:
    """(sources with random values, destinations) of CASES[case] on this rank (the probes' setup)."""
    model, sp, dp, _ = _cases(world)[case]
    return _pieces(model_layouts(model, sp), rank, random=True), _pieces(model_layouts(model, dp), rank)


RELAY_CASE = "relay-1to3"


def _relay_bench(args: argparse.Namespace, rank: int, world: int) -> None:
    """Rank 0 holds the model (TP1), ranks 1-3 are three TP1 replicas: the same refit with
    the relay off, on in one stage (scatter, then forward) and on pipelined in stages
    (--relay-stages, 0: auto), in one run on separate destinations (other ranks idle).
    Source egress should be about 1x vs 3x the model bytes; the refit ends when the
    slowest rank does, so the ratio compares the slowest ranks' times."""
    src_l = model_layouts(LLAMA3_8B, Parallel(tp=1))
    dst_l = model_layouts(LLAMA3_8B, Parallel(tp=1, dp=3, offset=1))
    src = _pieces(src_l, rank, random=True)
    opts = {"off": rx.Options(relay=False),
            "1 stage": rx.Options(relay=True, tuning=rx.Tuning(relay_stages=1)),
            "staged": rx.Options(relay=True, tuning=rx.Tuning(relay_stages=args.relay_stages))}
    dst = {key: _pieces(dst_l, rank) for key in opts}
    batch = (args.max_batch_mb << 20) or None
    plans = {key: rx.plan(src, dst[key], max_batch_bytes=batch, options=o) for key, o in opts.items()}
    times = {key: _time(lambda p=p: rx.execute(p), args.iters) for key, p in plans.items()}
    same = all(torch.equal(a.view(torch.uint8), dst["off"][n][0].view(torch.uint8))
               for key in ("1 stage", "staged") for n, (a, _) in dst[key].items())
    row = (rank, {k: p.bytes_sent for k, p in plans.items()}, {k: p.bytes_received for k, p in plans.items()},
           times, same)
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if rank != 0:
        return
    model_bytes = total_bytes(src_l)
    staged = plans["staged"]
    print(f"\n== {RELAY_CASE}: {LLAMA3_8B.layers} layers, {len(src_l)} tensors ({model_bytes / 1e9:.2f} GB), "
          f"{torch.cuda.get_device_name()} x{world}; {staged.relayed_tensors} tensors relayed, "
          f"{len(getattr(staged, 'phases', ())) - 1} group(s) in {len(getattr(staged, 'phases', ()))} stages "
          f"(--relay-stages {args.relay_stages or 'auto'})")
    keys = list(opts)
    print(f"{'rank':>4} " + " ".join(f"{'egress GB ' + k:>17}" for k in keys) + " "
          + " ".join(f"{'ms ' + k:>10}" for k in keys) + f" {'staged/off':>10} {'bits == off':>11}")
    for r, sent, _recv, t, eq in rows:
        print(f"{r:4d} " + " ".join(f"{sent[k] / 1e9:17.2f}" for k in keys) + " "
              + " ".join(f"{1e3 * t[k]:10.2f}" for k in keys) + f" {t['staged'] / t['off']:10.3f} {eq!s:>11}")
    slowest = {k: max(r[3][k] for r in rows) for k in keys}
    egress = {k: rows[0][1][k] / model_bytes for k in keys}
    print("source egress / model bytes: " + ", ".join(f"{k} {egress[k]:.3f}x" for k in keys))
    print("refit time (slowest rank): " + ", ".join(f"{k} {1e3 * slowest[k]:.2f} ms" for k in keys))
    print(f"ratio relay/no-relay (slowest ranks): 1 stage {slowest['1 stage'] / slowest['off']:.3f}, "
          f"staged {slowest['staged'] / slowest['off']:.3f} (must hold: <= 0.6; ideal 1 stage (1 + 2/3) / 3 = 0.556, "
          f"G stages (G + 1) / 3G); bit for bit relay == no relay on every rank: {all(r[4] for r in rows)}")


def _ratio(ceil: float, t: float) -> str:
    return f"{ceil / t:7.2f}" if ceil and t else "      -"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=sorted(CASES) + [RELAY_CASE], required=True)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--max-batch-mb", type=int, default=0)
    ap.add_argument("--relay-stages", type=int, default=0, help=f"{RELAY_CASE}: rx.Tuning(relay_stages) of the "
                    "staged relay (0: auto)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--backend", default="auto",
                    help="rx.plan backend, or a comma list timed one after the other on the same tensors "
                         "(e.g. nccl,direct,nvshmem; choices: " + ",".join(BACKENDS) + "); the first one also "
                         "runs --mxfp8, --trace and --transfers-only (NCCL only)")
    ap.add_argument("--variants", default="",
                    help="';'-separated rx.Options variants, each timed with every backend on the same tensors "
                         "(an A/B in one run), e.g. ';direct_local_engine_bytes=0;direct_engine_batch=false' "
                         "(an empty variant = the defaults)")
    ap.add_argument("--mxfp8", choices=["receiver", "sender"],
                    help="also refit with rx.MXFP8 converting the linear weights")
    ap.add_argument("--codec", choices=["mxfp8", "fp8block", "nvfp4"], default="mxfp8",
                    help="the format --mxfp8 SIDE quantizes into (fp8block: rx.FP8Block, 128x128 blocks, FP32 scales; "
                         "nvfp4: rx.NVFP4 with --scale-layout); with --variants, once per variant")
    ap.add_argument("--scale-layout", choices=["2d", "swizzled"], default="swizzled")
    ap.add_argument("--trace", "--timeline", dest="trace", action="store_true",
                    help="print one execute's CUDA-event timeline per rank (with --verify: and a verified one's; "
                         "with --mxfp8: the quantized refit's too; the direct transport's shows the staged chunks)")
    ap.add_argument("--verify", action="store_true", help="also time rx.execute(plan, verify=True) (a column)")
    ap.add_argument("--transfers-only", action="store_true",
                    help="also time the plan's batched NCCL transfers alone (no pack/unpack/copy): "
                         "the per-batch cost of the link without the kernels competing for HBM")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600),
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    if args.case == RELAY_CASE:
        if world >= 4:
            _relay_bench(args, rank, world)
        elif rank == 0:
            print(f"{RELAY_CASE}: needs 4 GPUs, have {world}: skipped")
        dist.destroy_process_group()
        return
    model, sp, dp_, need = _cases(world)[args.case]
    if world < need:
        if rank == 0:
            print(f"{args.case}: needs {need} GPUs, have {world}: skipped")
        return
    src_l = model_layouts(model, sp)
    dst_l = model_layouts(model, dp_)
    src, dst = _pieces(src_l, rank, random=True), _pieces(dst_l, rank)
    backends = args.backend.split(",")
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise SystemExit(f"--backend: unknown {unknown}; choose from {', '.join(BACKENDS)}")
    runs = [(b, v) for b in args.backend.split(",") for v in (args.variants.split(";") if args.variants else [""])]
    backends = [b + (f"[{v}]" if v else "") for b, v in runs]
    plans, t_refits = [], []
    for b, v in runs:
        p = rx.plan(src, dst, max_batch_bytes=(args.max_batch_mb << 20) or None, backend=b, options=_options(v))
        plans.append(p)
        t_refits.append(_time(lambda p=p: rx.execute(p), args.iters))
    plan, t_refit = plans[0], t_refits[0]
    t_verifies = [_time(lambda p=p: rx.execute(p, verify=True), args.iters) if args.verify else 0.0 for p in plans]
    timeline = _timeline(args, plan)

    if args.transfers_only and plan.backend == "nccl":
        tr = plan.transport
        # NcclComm.exchange takes (peer, ptr, bytes) tuples
        batches = [tuple([(m.peer, m.ptr, m.bytes) for m in side] for side in tr.transfers(b))
                   for b in range(plan.num_batches)]

        def transfers() -> None:
            stream = torch.cuda.current_stream().cuda_stream
            for sends, recvs in batches:
                tr.comm.exchange(sends, recvs, stream, 0)

        t_xfer = _time(transfers, args.iters)
        line = (f"rank {rank}: {plan.num_batches} batched transfers alone {t_xfer * 1e3:.2f} ms "
                f"(refit {t_refit * 1e3:.2f} ms)")
        print(line, flush=True)
    # ceilings, same run: NCCL send/recv of the same per-peer bytes; D2D copy of the local bytes
    t_nccl = nccl_ceiling(plan, args.iters)
    t_nccl_reg = nccl_ceiling(plan, args.iters, register=True)
    t_ce = peer_copy_ceiling(plan, args.iters)
    t_link = min(t for t in (t_nccl, t_ce) if t) if (t_nccl or t_ce) else 0.0  # the faster carrier
    local_bytes = sum(t.numel() * t.element_size() for t, _ in dst.values()) - plan.bytes_received
    t_d2d = d2d_time(local_bytes, args.iters)
    # the physical floor of a collocated refit: its peer copies and its same-rank copy at once
    t_both = peer_copy_ceiling(plan, args.iters, local_bytes) if t_ce and local_bytes > 0 else 0.0
    t_base = 0.0
    if not args.no_baseline:
        t_base = _time(_megatron_style(src, dst, src_l, dst_l, rank), max(2, args.iters // 2))
    # the quantized refit once per --variants entry (an A/B of the direct transport's knobs on it)
    variants = args.variants.split(";") if args.variants else [""]
    mx = [_mxfp8_refit(args, src, src_l, dst_l, rank, _options(v)) for v in variants] if args.mxfp8 else None
    row = (rank, plan.bytes_sent, plan.bytes_received, local_bytes, t_refit, t_link, t_d2d, t_base, plan.num_ops,
           plan.num_batches, t_nccl_reg, mx, timeline, t_nccl, t_ce, t_verifies, t_refits, [p.routes for p in plans],
           [hbm_per_byte(p) for p in plans], t_both)
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(f"\n== {args.case}: {model.layers} layers, {len(src_l)} tensors, "
              f"{torch.cuda.get_device_name()} x{world}, "
              f"batches {plan.num_batches}, backend {backends[0]}")
        print(f"{'rank':>4} {'sent GB':>8} {'recv GB':>8} {'local GB':>8} {'refit ms':>9} {'link GB/s':>9} "
              f"{'link ms':>8} {'vs ceil':>7} {'d2d ms':>7} {'megatron-style ms':>17} {'speedup':>7} "
              f"{'nccl reg ms':>11} {'vs reg':>6} {'nccl ms':>8} {'ce ms':>7} {'ce+loc ms':>9} {'vs phys':>7} "
              f"{'hbm/B':>5}" +
              (f" {'verify ms':>9} {'cost':>6}" if args.verify else ""))
        for r, sent, recv, loc, t, tn, td, tb, _ops, _nb, tnr, _, _, t_n, t_c, tvs, _, _, hbm, t_both in rows:
            tv = tvs[0]
            link = max(sent, recv)
            gbs = link / t / 1e9 if t else 0
            ceil = max(tn, td)  # link and local copies run concurrently: the slower is the floor
            vs = f"{ceil / t:7.2f}" if ceil else "      -"
            sp_ = f"{tb / t:7.2f}" if tb else "      -"
            vr = f"{max(tnr, td) / t:6.2f}" if tnr else "     -"
            cost = f" {1e3 * tv:9.2f} {100 * (tv / t - 1):+5.1f}%" if args.verify and t else ""
            print(f"{r:4d} {sent / 1e9:8.2f} {recv / 1e9:8.2f} {loc / 1e9:8.2f} {1e3 * t:9.2f} {gbs:9.1f} "
                  f"{1e3 * tn:8.2f} {vs} {1e3 * td:7.2f} {1e3 * tb:17.2f} {sp_} {1e3 * tnr:11.2f} {vr} "
                  f"{1e3 * t_n:8.2f} {1e3 * t_c:7.2f} {1e3 * t_both:9.2f} {_ratio(max(t_both, tn, td), t)} "
                  f"{hbm[0]:5.2f}{cost}")
        print("link = the faster of NCCL send/recv of the same bytes (nccl) and copy-engine peer copies of them "
              "(ce), every rank at once; vs ceil = max(link, D2D copy of the local bytes) / refit time "
              "(1.00 = at the ceiling); ce+loc = the ce copies and a D2D copy of the local bytes at the same "
              "time (the physical floor of a refit that moves both), vs phys = max(ce+loc, link, D2D) / refit time; "
              "hbm/B = HBM bytes read + written on the GPU per byte landing in its "
              "destinations, from the plan (same-rank copies 2, direct writes and unstaged messages 1 per end, "
              "staging 2 more per end); "
              "speedup = megatron-style time / refit time; nccl reg = the same send/recv between buffers "
              "registered with ncclCommRegister (NCCL's zero-copy intra-node path)")
        if len(backends) > 1:
            print(f"\n-- backends on the same tensors (refit ms, vs ceil; pairs of rank 0: "
                  f"{'; '.join(f'{b}: {p}' for b, p in zip(backends, rows[0][-3]))})")
            print(f"{'rank':>4} " + " ".join(f"{b + ' ms':>12} {'vs ceil':>7} {'vs phys':>7} {'hbm/B':>5}" +
                                             (f" {'verify ms':>9} {'cost':>6}" if args.verify else "")
                                             for b in backends))
            for r, _, _, _, _, tn, td, *rest in rows:
                ceil, phys = max(tn, td), max(tn, td, rest[-1])
                cells = [f"{1e3 * t:12.2f} {_ratio(ceil, t)} {_ratio(phys, t)} {h:5.2f}" +
                         (f" {1e3 * tv:9.2f} {100 * (tv / t - 1):+5.1f}%" if args.verify and t else "")
                         for t, h, tv in zip(rest[-4], rest[-2], rest[-5])]
                print(f"{r:4d} " + " ".join(cells))
        if args.mxfp8:
            layout = {"fp8block": "128x128 blocks, FP32 scales", "nvfp4": f"16-element blocks, {args.scale_layout} "
                      "E4M3 scales"}.get(args.codec, f"{args.scale_layout} scales")
            for i, variant in enumerate(variants):
                named = f" [{variant}]" if variant else ""
                print(f"\n-- {args.codec.upper()} ({args.mxfp8} side, {layout}) on the linear weights, same model"
                      f"{named}:")
                print(f"{'rank':>4} {'bf16 sent GB':>12} {'quant sent GB':>13} {'ratio':>6} "
                      f"{'converted: bf16 GB':>18} {'wire GB':>8} {'ratio':>6} {'bf16 ms':>8} {'quant ms':>9} "
                      f"{'time ratio':>10}" + (f" {'verify ms':>9} {'cost':>6}" if args.verify else ""))
                for r, sent, _, _, t, *_, mxs, _, _, _, _, _, _, _, _ in rows:  # noqa: B007
                    mx_sent, conv_bf16, mx_t, mx_tv, _, _ = mxs[i]
                    other = sent - conv_bf16  # bytes of tensors that travel unconverted
                    conv_wire = mx_sent - other
                    ratio = f"{mx_sent / sent:6.3f}" if sent else "     -"
                    cratio = f"{conv_wire / conv_bf16:6.3f}" if conv_bf16 else "     -"
                    cost = f" {1e3 * mx_tv:9.2f} {100 * (mx_tv / mx_t - 1):+5.1f}%" if args.verify and mx_t else ""
                    tratio = f"{mx_t / t:10.3f}" if t else "         -"
                    print(f"{r:4d} {sent / 1e9:12.2f} {mx_sent / 1e9:13.2f} {ratio} {conv_bf16 / 1e9:18.2f} "
                          f"{conv_wire / 1e9:8.2f} {cratio} {1e3 * t:8.2f} {1e3 * mx_t:9.2f} {tratio}{cost}")
            print("time ratio = quantized refit / bf16 refit of the same model, same backend, same run (the bf16 "
                  f"refit of the first variant; routes of rank 0: {rows[0][11][0][4]})")
        for r, *_, mxs, timeline, _, _, _, _, _, _, _ in rows:
            if timeline:
                print(f"\n-- rank {r}: {timeline}")
            for variant, mx in zip(variants, mxs or []):
                if mx[5]:
                    print(f"\n-- rank {r}, {args.codec.upper()} {args.mxfp8} side{f' [{variant}]' if variant else ''}: "
                          f"{mx[5]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
