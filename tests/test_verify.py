"""Verified refits (issue 15, item 3): rx.execute(plan, verify=True) digests every piece
on the sender (what the receiver must hold) and on the receiver (what it wrote) inside
the box kernels and compares them; rx.verify(plan) re-reads the bound sources and
destinations and compares the same digests, moving nothing.

Three layers:
  - the digest through the kernel API (CPU twin, the CUDA kernel's per-lane code run on
    the host, the real kernel): bit-exact and position-sensitive, the same for every
    pass (copy, read source, read destination), every folding of a box and every backend;
  - refits over gloo: every layout of the refit matrix and the MXFP8 matrix passes
    verify=True and rx.verify, and corruption (in transit, or a destination changed
    after the refit) raises ReshardError on every rank naming tensor, box and ranks;
  - the same on GPUs (NCCL), skipped without them.
"""
from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch
from _boxes import BOX, random_specs, specs_table, table
from _cases import CASES, run_case
from _dist import gpu_of, gpus_for, own_gpus, run_ranks
from test_mxfp8_kernels import make_case

import reshard_ext as rx
from reshard_ext import _C
from reshard_ext.layout import code_of

HAVE_KERNEL = hasattr(_C, "DeviceBoxTable")
HAVE_GPU = HAVE_KERNEL and torch.cuda.is_available()
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
BACKENDS = [
    "twin",
    pytest.param("emulated", marks=pytest.mark.skipif(not HAVE_KERNEL, reason="built without CUDA")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAVE_GPU, reason="needs a GPU")]),
]
PASSES = {"copy": int(_C.PASS_COPY), "src": int(_C.PASS_SRC), "dst": int(_C.PASS_DST)}
BF16 = code_of(torch.bfloat16)


# ---- the digest through the kernel API ------------------------------------------------

def with_digest(tbl: bytes, specs: list[int]) -> bytes:
    """A box table with rx_box.digest set per box."""
    a = np.frombuffer(bytearray(tbl), dtype=BOX).copy()
    a["digest"] = specs
    return a.tobytes()


def digests(backend: str, tbl_of, bufs: dict[str, torch.Tensor], pass_: str, tile_bytes: int = 512,
            warp_shift: int = -1, max_blocks: int = 0) -> list[int]:
    """Runs verify pass `pass_` over the boxes tbl_of(buffers) returns (bytes), on copies of
    the CPU buffers `bufs` (updated in place with what a copy pass writes); one digest per box.
    warp_shift >= 0: the warps per tile instead of the table's; max_blocks > 0 caps the grid."""
    p = PASSES[pass_]
    if backend == "twin":
        return list(_C.digest_boxes_cpu(tbl_of(bufs), p))
    if backend == "emulated":
        return list(_C.DeviceBoxTable(tbl_of(bufs), tile_bytes).run_emulated(p, warp_shift))
    dev = {k: v.cuda() for k, v in bufs.items()}
    t = _C.DeviceBoxTable(tbl_of(dev), tile_bytes)
    blob = torch.empty(max(t.nbytes, 1), dtype=torch.uint8, device="cuda")
    out = torch.zeros(max(t.num_boxes, 1), dtype=torch.int64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    t.upload(blob.data_ptr(), stream)
    t.launch(stream, max_blocks, out.data_ptr(), p, warp_shift)
    for k, v in dev.items():
        bufs[k].copy_(v.cpu())
    return [int(x) for x in out.cpu().numpy().view(np.uint64)[: t.num_boxes]]


def whole(x: torch.Tensor, out: torch.Tensor) -> bytes:
    """One box over all of a contiguous x, copied into out (same shape)."""
    shape = tuple(x.shape)
    strides = tuple(x.stride())
    return table([(x.data_ptr(), out.data_ptr(), shape, strides, strides, code_of(x.dtype), code_of(out.dtype))])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8])
def test_digest_is_bit_exact_and_position_sensitive(backend, dtype):
    """Swapped rows, a NaN payload, -0.0 for +0.0, one flipped bit anywhere: all change
    the digest of what a box reads; the same bits give the same digest."""
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 256, (12, 40 * 8), dtype=torch.uint8, generator=g).view(dtype)
    if dtype.is_floating_point:
        base = torch.randn(base.shape, generator=g, dtype=torch.float64).to(dtype)

    def digest_of(x: torch.Tensor) -> int:
        bufs = {"x": x.clone(), "y": torch.empty_like(x)}
        return digests(backend, lambda b: whole(b["x"], b["y"]), bufs, "src")[0]

    ref = digest_of(base)
    assert digest_of(base.clone()) == ref
    variants = {"swapped rows": base[[0, 1, 5, 3, 4, 2, 6, 7, 8, 9, 10, 11]]}
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[base.element_size()]
    for flat_at in (0, 37, base.numel() - 1):
        v = base.clone().view(bits).view(-1)
        v[flat_at] ^= 1 << (8 * base.element_size() - 2)  # one bit, every position of the box
        variants[f"bit flipped at {flat_at}"] = v.view(base.shape).view(dtype)
    if dtype.is_floating_point:
        zeros = base.clone()
        zeros[3, 7] = 0.0
        neg = zeros.clone()
        neg[3, 7] = -0.0
        assert digest_of(zeros) != digest_of(neg), "-0.0 and +0.0 digest alike"
        nan = {torch.float32: (0x7FC00000, 0x7FC00001), torch.float64: (0x7FF8000000000000, 0x7FF8000000000001),
               torch.bfloat16: (0x7FC0, 0x7FC1)}[dtype]
        a, b = base.clone().view(bits), base.clone().view(bits)
        a[5, 5], b[5, 5] = nan
        assert digest_of(a.view(dtype)) != digest_of(b.view(dtype)), "NaN payloads digest alike"
    for what, x in variants.items():
        assert digest_of(x) != ref, what


def _random_boxes(seed: int, count: int, max_elems: int, casts: bool, big: int | None = None):
    """Random boxes (strided, folded or not, misaligned, casting) over random source bytes:
    (buffers, table maker, the twin's digests of what they write, the plain copy's result)."""
    specs, sb, db = random_specs(seed=seed, count=count, max_elems=max_elems, casts=casts, big=big)
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (sb,), dtype=torch.uint8, generator=g)
    src[1::2] &= 0xBF  # finite floats: cast NaN payloads are not the point here
    bufs = {"src": src, "dst": torch.zeros(db, dtype=torch.uint8)}

    def tbl(b):
        return specs_table(specs, b["src"], b["dst"])

    want = digests("twin", tbl, {k: v.clone() for k, v in bufs.items()}, "src")
    reference = {k: v.clone() for k, v in bufs.items()}
    _C.copy_boxes_cpu(tbl(reference))
    return bufs, tbl, want, reference["dst"]


def _passes_agree(backend: str, bufs, tbl, want, copied_ref, **launch) -> None:
    """Every pass's digests equal `want`, and the copy pass writes what the plain copy does."""
    copied = {k: v.clone() for k, v in bufs.items()}
    for pass_, b in (("copy", copied), ("src", {k: v.clone() for k, v in bufs.items()}), ("dst", copied)):
        got = digests(backend, tbl, b, pass_, **launch)
        assert got == want, (pass_, launch, [i for i, (x, y) in enumerate(zip(got, want)) if x != y])
    assert torch.equal(copied["dst"], copied_ref), ("the copy pass must copy what the plain copy does", launch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("casts", [False, True])
def test_passes_and_foldings_agree(backend, casts):
    """For random boxes: the digest of the copy as it writes = of what it would write
    (source read) = of what the destination then holds, and equals the CPU twin's."""
    _passes_agree(backend, *_random_boxes(11 + casts, 60, 700, casts))


@pytest.mark.parametrize("backend", BACKENDS[1:])  # the twin has no tiles
@pytest.mark.parametrize("casts", [False, True])
def test_warps_sharing_a_tile_digest_all_of_it(backend, casts):
    """Every share count 1..32 per tile (whole warp passes each, some empty; on the GPU the
    warps of a block sharing a tile add their sums before the atomics), uncapped and with
    grids capped below one warp per share: every pass gives the twin's digests, and the
    copy pass writes what the plain copy does."""
    case = _random_boxes(31 + casts, 40, 3000, casts, big=1 << 16)
    for shift in range(6):
        for cap in [0] if backend == "emulated" else [0, 1, 3, 40]:
            _passes_agree(backend, *case, tile_bytes=8192, warp_shift=shift, max_blocks=cap)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
def test_digest_counts_ordinals_not_addresses(backend, dtype):
    """A 1-D run at every misalignment modulo 16 bytes (the kernel reads its body as
    16-byte items from an aligned base and its first ordinal from the offset; src and
    dst equally misaligned or not): every pass gives the digest of the aligned run."""
    es = torch.empty(0, dtype=dtype).element_size()
    n = 16 * 37 // es + 3  # head, body and tail items
    g = torch.Generator().manual_seed(17)
    values = torch.randint(0, 256, (n * es,), dtype=torch.uint8, generator=g)

    def run_at(src_off: int, dst_off: int):
        return lambda b: table([(b["src"].data_ptr() + src_off, b["dst"].data_ptr() + dst_off, (n,), (1,), (1,),
                                 code_of(dtype), code_of(dtype))])

    def bufs_at(src_off: int) -> dict:
        src = torch.zeros(n * es + 32, dtype=torch.uint8)
        src[src_off:src_off + n * es] = values
        return {"src": src, "dst": torch.zeros(n * es + 32, dtype=torch.uint8)}

    want = digests("twin", run_at(0, 0), bufs_at(0), "src")
    for src_off in range(0, 16, es):
        for dst_off in {src_off, (src_off + es) % 16}:
            bufs = bufs_at(src_off)
            for pass_ in ("copy", "dst", "src"):
                assert digests(backend, run_at(src_off, dst_off), bufs, pass_) == want, (src_off, dst_off, pass_)
            assert torch.equal(bufs["dst"][dst_off:dst_off + n * es], values)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ["as written", "cast", "mx"])
def test_pieces_add_up_to_the_whole(backend, spec):
    """A run cut into pieces whose first ordinal is a copy's param[0] (RX_BOX_FIRST_ORDINAL:
    the verify rounds of direct receives): their digests add up (digest::add) to the whole run's, and the
    same pieces with ordinals from 0 do not."""
    n, cuts = 8192 * 3, [0, 8192, 8192 + 2048, 3 * 8192]
    x = make_case("wide", rows=1, cols=n, seed=9).view(-1)
    bufs = {"x": x, "y": torch.zeros_like(x)}
    digest = {"as written": 0, "cast": int(_C.DIGEST_CAST) | code_of(torch.float32) << 8,
              "mx": int(_C.DIGEST_MX) | int(_C.MX_ROUND_CEIL) << 8}[spec]

    def run(b, first_ordinals=True):
        rows = [(b["x"].data_ptr() + 2 * a, b["y"].data_ptr() + 2 * a, (e - a,), (1,), (1,), BF16, BF16, 0,
                 a if first_ordinals else 0) for a, e in itertools.pairwise(cuts)]
        return with_digest(table(rows), [digest] * len(rows))

    whole_run = digests("twin", lambda b: with_digest(whole(b["x"], b["y"]), [digest]), dict(bufs), "src")[0]
    for pass_ in ("src", "copy", "dst"):
        assert _added(digests(backend, run, bufs, pass_)) == whole_run, pass_
    assert _added(digests(backend, lambda b: run(b, False), bufs, "src")) != whole_run


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("dst_offset", [0, 8, 24, 40])
@pytest.mark.parametrize("n", [1, 37, 5000])
def test_cold_copy_pass_copies_and_digests_as_the_copy_pass(dtype, dst_offset, n):
    """PASS_COPY_COLD (stores past the cache into tensors no one reads soon) writes the same
    bytes and the same digest as PASS_COPY, from any destination alignment: its head up to
    the first 32-byte boundary is copied apart from the streamed body."""
    size = torch.empty((), dtype=dtype).element_size()
    src = torch.randint(0, 255, (n * size,), dtype=torch.uint8)
    out = {}
    for name in ("copy", "cold"):
        dst = torch.zeros(n * size + 64, dtype=torch.uint8)
        at = dst.data_ptr() + dst_offset // size * size
        tbl = table([(src.data_ptr(), at, (n,), (1,), (1,), code_of(dtype), code_of(dtype))])
        pass_ = _C.PASS_COPY if name == "copy" else _C.PASS_COPY_COLD
        out[name] = (list(_C.digest_boxes_cpu(tbl, pass_)), dst.clone())
    assert out["cold"][0] == out["copy"][0]
    assert torch.equal(out["cold"][1], out["copy"][1])
    lo = dst_offset // size * size
    assert torch.equal(out["cold"][1][lo:lo + n * size], src)


def test_first_ordinal_is_checked():
    """A copy's first verify ordinal (param[0]) is >= 0, and a piece digested as the
    receiver's MXFP8 quantize holds it starts on a block (a multiple of 32): else refused."""
    x = make_case("wide", rows=1, cols=64, seed=3).view(-1)
    y = torch.zeros_like(x)
    mx = int(_C.DIGEST_MX) | int(_C.MX_ROUND_CEIL) << 8

    def box(first, digest):
        return with_digest(table([(x.data_ptr(), y.data_ptr(), (64,), (1,), (1,), BF16, BF16, 0, first)]), [digest])

    _C.digest_boxes_cpu(box(32, mx), PASSES["src"])
    _C.digest_boxes_cpu(box(16, 0), PASSES["src"])
    for first, digest in ((16, mx), (-1, 0)):
        with pytest.raises(rx.InternalError, match="bad box"):
            _C.digest_boxes_cpu(box(first, digest), PASSES["src"])


def _reference_digest(bits: np.ndarray, size: int, first: int) -> int:
    """kernels/digest.h from its definition: the sum, lane by lane, of the 64-bit squares of
    each element's 32-bit words xor their ordinal's key (an 8-byte element's high word
    keyed + kHiSalt)."""
    k = np.arange(first, first + bits.size, dtype=np.uint64)
    key = ((k & np.uint64(0xFFFFFFFF)) * np.uint64(0x9E3779B9) + (k >> np.uint64(32)) * np.uint64(0x7FEB352D)) \
        & np.uint64(0xFFFFFFFF)
    words = [(bits.astype(np.uint64) & np.uint64(0xFFFFFFFF), key)]
    if size == 8:
        words.append((bits.astype(np.uint64) >> np.uint64(32), (key + np.uint64(0x6A09E667)) & np.uint64(0xFFFFFFFF)))
    lo = hi = 0
    for w, kw in words:
        sq = (w ^ kw) * (w ^ kw)
        lo += int((sq & np.uint64(0xFFFFFFFF)).sum(dtype=np.uint64))
        hi += int((sq >> np.uint64(32)).sum(dtype=np.uint64))
    return (lo & 0xFFFFFFFF) | (hi & 0xFFFFFFFF) << 32


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
def test_digest_matches_its_definition(backend, dtype):
    """Every length (vector bodies and scalar tails of the CPU twin, partial items of the
    kernel), and first ordinals whose low word wraps inside the run: the digest is the one
    kernels/digest.h defines, computed here independently."""
    es = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator().manual_seed(23)
    raw = torch.randint(0, 256, (200 * es,), dtype=torch.uint8, generator=g)
    uint = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[es]
    for n, first in [(1, 0), (7, 3), (16, 0), (33, 5), (200, 0), (200, 2**32 - 37), (64, 2**33 + 2**32 - 16)]:
        x = raw[:n * es].clone()
        bufs = {"x": x, "y": torch.zeros_like(x)}

        def row(b, n=n, first=first):
            return table([(b["x"].data_ptr(), b["y"].data_ptr(), (n,), (1,), (1,), code_of(dtype), code_of(dtype), 0,
                           first)])

        want = _reference_digest(x.numpy().view(uint), es, first)
        assert digests(backend, row, bufs, "src") == [want], (n, first)


def _added(ds: list[int]) -> int:
    """digest::add over digests (kernels/digest.h: two 32-bit lanes)."""
    return (sum(d & 0xFFFFFFFF for d in ds) & 0xFFFFFFFF) | (sum(d >> 32 for d in ds) & 0xFFFFFFFF) << 32


@pytest.mark.parametrize("backend", BACKENDS)
def test_cast_digest_matches_the_receivers_cast(backend):
    """A sender packs BF16 (the narrower wire); the receiver widens to fp32 on unpack. The
    pack box digested as fp32 (RX_DIGEST_CAST) equals the unpack box's digest, and differs
    from the plain BF16 one."""
    x = torch.randn(6, 64).to(torch.bfloat16)
    bufs = {"x": x, "wire": torch.zeros(6, 64, dtype=torch.bfloat16), "out": torch.zeros(6, 64)}
    cast = int(_C.DIGEST_CAST) | code_of(torch.float32) << 8
    pack = digests(backend, lambda b: with_digest(whole(b["x"], b["wire"]), [cast]), bufs, "copy")
    unpack = digests(backend, lambda b: whole(b["wire"], b["out"]), bufs, "copy")
    plain = digests(backend, lambda b: whole(b["x"], b["wire"]), bufs, "src")
    assert pack == unpack and pack != plain


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_mx_digest_of_bf16_equals_fused_quantize(backend, rounding):
    """A BF16 pack box whose receiver quantizes (RX_DIGEST_CODEC, MXFP8) digests what the receiver's
    fused MX_DATA box writes (E4M3 bytes and scales), whatever the scale layout, and a
    changed scale byte or data byte of the destination changes the destination digest."""
    r = {"ceil": int(_C.MX_ROUND_CEIL), "floor": int(_C.MX_ROUND_FLOOR)}[rounding]
    x = make_case("wide", rows=8, cols=128, seed=4)
    rows, k = x.shape
    bufs = {"x": x, "wire": torch.zeros_like(x), "data": torch.zeros(rows * k, dtype=torch.uint8),
            "scale": torch.zeros(rows * k // 32, dtype=torch.uint8)}
    u8 = code_of(torch.uint8)

    def pack(b):
        return with_digest(whole(b["x"], b["wire"]), [int(_C.DIGEST_MX) | r << 8])

    def fused(b):  # the receiver: BF16 wire -> E4M3 data + 2-D scales
        return table([(b["wire"].data_ptr(), b["data"].data_ptr(), (rows, k), (k, 1), (k, 1), BF16, u8,
                       int(_C.BOX_MX_DATA) | r << 8, b["scale"].data_ptr(), 0, k)])

    sent = digests(backend, pack, bufs, "copy")
    landed = digests(backend, fused, bufs, "copy")
    assert sent == landed == digests(backend, fused, bufs, "dst")
    assert sent != digests(backend, lambda b: whole(b["x"], b["wire"]), bufs, "src"), "not the BF16 digest"
    for name in ("data", "scale"):
        bad = {key: v.clone() for key, v in bufs.items()}
        bad[name][5] ^= 1
        assert digests(backend, fused, bad, "dst") != landed, f"a changed {name} byte went unnoticed"


# ---- refits over gloo ------------------------------------------------------------------

def verified(rank: int, world: int, worker, *args):
    """Runs `worker` with every rx.execute verified and followed by rx.verify."""
    plain = rx.execute

    def execute(plan, **kw):
        plain(plan, verify=True)
        rx.verify(plan)

    rx.execute = execute
    try:
        return worker(rank, world, *args)
    finally:
        rx.execute = plain


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("max_batch_bytes", [None, 1024])  # 1024: staging bounded hard, many batches
def test_verified_matrix(case, max_batch_bytes):
    run_ranks(4, verified, run_case, case, "cpu", max_batch_bytes)


def _direct(rank, world, case):
    # every contiguous op travels from / into its tensor
    return run_case(rank, world, case, "cpu", None, options=rx.Options(tuning=rx.Tuning(direct_bytes=1)))


@pytest.mark.parametrize("case", ["tp", "casts", "pp_experts"])
def test_verified_direct_messages(case):
    """Ops sent straight from / received into tensors have no pack or unpack: their
    digests come from reading each round's sources before it leaves and its destinations
    once it landed (several rounds: test_verify_rounds_cut_alike_and_add_up)."""
    run_ranks(4, verified, _direct, case)


@pytest.mark.parametrize("layout_kind", ["2d", "swizzled"])
@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_verified_mxfp8(where, layout_kind):
    """Digests cover the MXFP8 bytes the receiver holds: fused or staged, either side,
    2-D or swizzled scales, and with ops moving as direct messages."""
    from test_mxfp8_refit import refit_worker

    run_ranks(4, verified, refit_worker, where, layout_kind, "ceil")
    if layout_kind == "2d":
        run_ranks(4, verified, refit_worker, where, layout_kind, "floor", "cpu", 1)


def _corrupt_after_refit(rank, world, device, target):
    """Ranks 0, 1: a plain tensor (0 -> 1 over the wire, and a same-rank copy on 0) and an
    MXFP8 one (quantized on the receiver). After a verified refit one rank changes one
    byte of `target`; rx.verify must raise on every rank."""
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    g = torch.Generator().manual_seed(9)
    w = torch.randn(16, 64, generator=g)
    m = make_case("normal", rows=8, cols=64, seed=1)
    one, both = rx.Mesh([0]), rx.Mesh([0, 1])
    sw = rx.Layout((16, 64), torch.float32, one, [rx.Replicate()])
    dw = rx.Layout((16, 64), torch.float32, both, [rx.Replicate()])
    sm = rx.Layout((8, 64), torch.bfloat16, one, [rx.Replicate()])
    dm = rx.Layout((8, 64), torch.bfloat16, both, [rx.Replicate()])
    src = {"w": (w.to(dev), sw), "m": (m.to(dev), sm)} if rank == 0 else {}
    out = torch.zeros(16, 64, device=dev)
    data = torch.zeros(8, 64, dtype=torch.float8_e4m3fn, device=dev)
    scale = torch.zeros(8, 2, dtype=torch.uint8, device=dev)
    plan = rx.plan(src, {"w": (out, dw), "m": ((data, scale), dm)}, transform=rx.MXFP8(["m"]))
    rx.execute(plan, verify=True)
    rx.verify(plan)  # intact: passes
    victim, tensor = target
    if rank == victim:
        t = {"w": out, "data": data, "scale": scale}[tensor]
        t.view(torch.uint8).view(-1)[7] ^= 0x10
    try:
        rx.verify(plan)
    except rx.ReshardError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("target", [(1, "w"), (0, "w"), (1, "data"), (1, "scale")],
                         ids=["received", "copied", "mxfp8-data", "mxfp8-scale"])
def test_verify_catches_a_changed_destination(target):
    victim, tensor = target
    name = "'w'" if tensor == "w" else "'m'"
    for msg in run_ranks(2, _corrupt_after_refit, "cpu", target):
        assert "rx.verify" in msg and name in msg and f"rank {victim}" in msg, msg
        assert "[0:" in msg  # the box, in global coordinates


def _flip_in_ring(channel, sender):
    """Flips a bit of the first chunk from `sender` waiting in this rank's ring (HostRing's
    layout: a 64-byte segment head, then per rank of the host a head line, a tail line and
    the slots, each a 64-byte slot head and its data), once the sender has written it."""
    import numpy as np

    from reshard_ext.transports import channel as chm

    slots, slot_bytes = chm._RING_SLOTS, chm._RING_SLOT_BYTES
    seg = np.memmap("/dev/shm" + channel._ring.name, dtype=np.uint8, mode="r+")
    ring = 64 + sender * (128 + slots * (64 + slot_bytes))  # every rank of the test's group is local
    words = seg[ring : ring + 72].view(np.uint64)
    deadline = time.monotonic() + 30
    while words[0] == words[8]:  # head == tail: nothing written yet
        assert time.monotonic() < deadline, "the sender wrote nothing into the ring"
        time.sleep(1e-3)
    seg[ring + 128 + int(words[8]) % slots * (64 + slot_bytes) + 64 + 100] ^= 4
    seg.flush()


def _corrupt_in_transit(rank, world, direct, rings):
    """Rank 1 flips a bit of what arrives from rank 0 before it unpacks: the refit is
    silently wrong without verify, and raises with it. Over gloo the bit flips in the
    received message; in the shared-memory rings, in the chunk waiting in its slot."""
    g = torch.Generator().manual_seed(2)
    full = torch.randn(64, 32, generator=g)
    s = rx.Layout((64, 32), torch.float32, rx.Mesh([0]), [rx.Replicate()])
    d = rx.Layout((64, 32), torch.float32, rx.Mesh([1]), [rx.Replicate()])
    plan = rx.plan({"x": (full.clone(), s)} if rank == 0 else {},
                   {"x": (torch.zeros(64, 32), d)} if rank == 1 else {},
                   options=rx.Options(tuning=rx.Tuning(direct_bytes=1 if direct else 1 << 30, host_ring=rings)))
    if rank == 1:
        from reshard_ext.transports.channel import HEADER_TAG

        channel = plan.transport.channel
        exchange = channel.exchange
        ring_exchange = channel._ring_exchange

        def corrupting_exchange(ops, tag, session, retry_closed=False, **kw):
            errors = exchange(ops, tag, session, retry_closed, **kw)
            for kind, _, tensor in ops:
                if kind == "recv" and tag != HEADER_TAG and not rings:
                    tensor.view(-1)[100] ^= 4
            return errors

        def corrupting_ring_exchange(ops, token, session, hashed):
            _flip_in_ring(channel, 0)
            return ring_exchange(ops, token, session, hashed)

        channel.exchange = corrupting_exchange
        channel._ring_exchange = corrupting_ring_exchange
    try:
        rx.execute(plan)  # no verify: nothing notices
        wrong = rank == 1 and not torch.equal(plan._entries["dst"]["x"][0], full)
        errors = []
        for _ in range(2):  # every execute checks again
            try:
                rx.execute(plan, verify=True)
            except rx.ReshardError as e:
                errors.append(str(e))
    finally:
        if rank == 1:  # the channel is the group's, shared by later plans in this process
            del channel.exchange
            del channel._ring_exchange
    return errors, wrong


@pytest.mark.parametrize("rings", [False, True], ids=["gloo", "rings"])
@pytest.mark.parametrize("direct", [False, True], ids=["staged", "direct"])
def test_execute_verify_catches_corruption_in_transit(direct, rings):
    results = run_ranks(2, _corrupt_in_transit, direct, rings)
    assert results[1][1], "the corruption must reach rank 1's destination"
    for errors, _ in results:
        assert len(errors) == 2, errors
        assert "rx.execute(verify=True)" in errors[0] and "'x'[0:64, 0:32]" in errors[0], errors[0]
        assert "from rank 0 to rank 1" in errors[0], errors[0]


def _rounds(rank, world):
    """A 2 MiB tensor that travels as one direct message and a small one staged beside it
    (rank 0 -> 1), cut into the verify rounds of the NCCL path: each end's pieces tile
    its messages in order at aligned offsets, both ends cut alike, and the digests of the
    direct receive's pieces add up to the digest of the whole received op."""
    g = torch.Generator().manual_seed(4)
    full = {"x": torch.randn(1024, 512, generator=g), "y": torch.randn(8, 8, generator=g)}
    lay = {k: (rx.Layout(tuple(v.shape), torch.float32, rx.Mesh([0]), [rx.Replicate()]),
               rx.Layout(tuple(v.shape), torch.float32, rx.Mesh([1]), [rx.Replicate()])) for k, v in full.items()}
    dst = {k: torch.zeros_like(v) for k, v in full.items()}
    plan = rx.plan({k: (v.clone(), lay[k][0]) for k, v in full.items()} if rank == 0 else {},
                   {k: (v, lay[k][1]) for k, v in dst.items()} if rank == 1 else {},
                   options=rx.Options(tuning=rx.Tuning(direct_bytes=1 << 20)))
    tables = plan.tables
    n_rounds = _C.verify_rounds(tables.num_batches)  # what the NCCL executor cuts
    cuts = []
    for b in range(tables.num_batches):
        for side in (0, 1):
            rounds = [tables.round_messages(b, r, n_rounds)[side] for r in range(n_rounds)]
            cuts += [(b, r, m.bytes) for r, ms in enumerate(rounds) for m in ms]
            pieces = [m for ms in rounds for m in ms]
            for peer in {m.peer for m in tables.messages(b)[side]}:
                whole_msgs = [m for m in tables.messages(b)[side] if m.peer == peer]
                at = iter(sorted((m for m in pieces if m.peer == peer), key=lambda m: m.ptr))
                for whole in sorted(whole_msgs, key=lambda m: m.ptr):  # each message is its pieces, in order
                    end = whole.ptr
                    while end < whole.ptr + whole.bytes:
                        piece = next(at)
                        assert piece.ptr == end and (piece.ptr - whole.ptr) % 16384 == 0, (piece, whole)
                        end += piece.bytes
                    assert end == whole.ptr + whole.bytes
                assert next(at, None) is None
    assert len(cuts) > n_rounds, "a 2 MiB message must be cut into rounds (and the small one stays whole)"
    import reshard_ext.transports.cpu as cpu
    cpu.VERIFY_PIECE = 4 * 16384  # the verified execute moves the 2 MiB message in 32 rounds
    rx.execute(plan, verify=True)
    if rank == 1:
        assert all(torch.equal(dst[k], full[k]) for k in full)
        recv = plan.transport.read_digests(tables)[1]
        added = np.zeros_like(recv)
        direct = [op for b in range(tables.num_batches) for op in tables.direct_recvs(b)]
        for b in range(tables.num_batches):
            for r in range(n_rounds):
                tables.digest_direct_recv_round_cpu(b, r, n_rounds, added)
        assert len(direct) == 1 and added[direct[0]] == recv[direct[0]] != 0
    # gloo's rounds of `piece` bytes (transports/cpu.py): each end's pieces add up too
    side = 0 if rank == 0 else 1
    whole = plan.transport.read_digests(tables)[side]
    added = np.zeros_like(whole)
    piece = 4 * 16384
    for b in range(tables.num_batches):
        n = tables.piece_rounds(b, piece)
        if tables.direct_sends(b) or tables.direct_recvs(b):
            assert n == (2 << 20) // piece  # the 2 MiB message, in 64 KiB rounds
        for r in range(n):
            if side == 0:
                tables.digest_direct_send_round_cpu(b, r, n, added, piece)
            else:
                tables.digest_direct_recv_round_cpu(b, r, n, added, piece)
    direct = [op for b in range(tables.num_batches) for op in (tables.direct_recvs(b) if side else
                                                               tables.direct_sends(b))]
    assert len(direct) == 1 and added[direct[0]] == whole[direct[0]] != 0
    return cuts


def test_verify_rounds_cut_alike_and_add_up():
    send_cuts, recv_cuts = run_ranks(2, _rounds)
    assert send_cuts == recv_cuts and len({r for _, r, _ in send_cuts}) == 8


def _idle_and_empty(rank, world):
    """Ranks with nothing to move (and plans that move nothing) still verify. A plan in
    which no rank sends to another has nothing for verify=True to check (no collective);
    one with a single pair checks on every rank, idle ones included."""
    from reshard_ext import verification

    checks = []
    check = verification.check
    verification.check = lambda *a, **k: (checks.append(k.get("what")), check(*a, **k))[1]
    try:  # the pool's processes serve later tests: the spy goes with this one
        s = rx.Layout((4, 4), torch.float32, rx.Mesh([0]), [rx.Replicate()])
        t = rx.Layout((4, 4), torch.float32, rx.Mesh([1]), [rx.Replicate()])
        plan = rx.plan({"x": (torch.ones(4, 4), s)} if rank == 0 else {},
                       {"x": (torch.zeros(4, 4), s)} if rank == 0 else {})
        rx.execute(plan, verify=True)
        local = list(checks)
        rx.verify(plan)
        out = torch.zeros(4, 4)
        moves = rx.plan({"x": (torch.ones(4, 4), s)} if rank == 0 else {}, {"x": (out, t)} if rank == 1 else {})
        rx.execute(moves, verify=True)
    finally:
        verification.check = check
    return local, checks, bool((out == 1).all()) if rank == 1 else None


def test_idle_ranks_verify():
    for rank, (local, checks, landed) in enumerate(run_ranks(4, _idle_and_empty)):
        assert local == [] and checks == ["rx.verify", "rx.execute(verify=True)"], (rank, checks)
        assert landed is (True if rank == 1 else None), (rank, landed)


def _error_of(fn, *args, **kwargs) -> str:
    """The message of the ReshardError fn raises ("" where it returns)."""
    try:
        fn(*args, **kwargs)
    except rx.ReshardError as e:
        return str(e)
    return ""


def _exchanging_plan(rank: int, world: int, seed: int):
    """A plan in which every rank sends to and receives from every other one."""
    shape = (8 * world, 4 * world)
    src_l = rx.Layout(shape, torch.float32, rx.Mesh(list(range(world))), [rx.Shard(0)])
    dst_l = rx.Layout(shape, torch.float32, rx.Mesh(list(range(world))), [rx.Shard(1)])
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    out = torch.zeros(dst_l.local_shape(rank))
    plan = rx.plan({"w": (src_l.local_part(g, rank), src_l)}, {"w": (out, dst_l)})
    return plan, out, dst_l.local_part(g, rank)


def _check_paths(rank, world):
    """The check adds up the ranks' sums in the execute's outcome (transports/outcome.py):
    through the mailboxes where the ranks share a host, by recursive doubling over the
    channel's gloo pairs otherwise; no collective over the caller's group either way."""
    import torch.distributed as dist

    plan, out, want = _exchanging_plan(rank, world, seed=3)
    rx.execute(plan)
    calls = []
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), all_reduce(*a, **k))[1]
    try:  # the pool's processes serve later tests: the spy and the override go with this one
        rx.execute(plan, verify=True)
        rx.verify(plan)
        through_mailboxes = len(calls)
        plan.transport.channel._all_local = False
        rx.execute(plan, verify=True)
        rx.verify(plan)
        over_gloo = len(calls) - through_mailboxes
        out.view(torch.int32).view(-1)[rank] ^= 1  # caught either way
        caught = []
        for local in (None, False):
            plan.transport.channel._all_local = local
            try:
                rx.verify(plan)
            except rx.ReshardError as e:
                caught.append(str(e))
        out.view(torch.int32).view(-1)[rank] ^= 1
    finally:
        dist.all_reduce = all_reduce
        plan.transport.channel._all_local = None
    return through_mailboxes, over_gloo, caught, bool(torch.equal(out, want))


def test_cpu_check_rides_in_the_outcome():
    for rank, (mailboxes, gloo, caught, ok) in enumerate(run_ranks(4, _check_paths)):
        assert mailboxes == 0 and gloo == 0, (rank, mailboxes, gloo)
        assert len(caught) == 2 and all("rx.verify" in m and "'w'" in m for m in caught), (rank, caught)
        assert ok


def _late_to_the_check(rank, world):
    """Rank 1 reaches the execute's outcome (which carries the digest sums) 4 s late; rank 0
    gives up after its 1.5 s timeout and as long a grace. Then both execute again, verified."""
    import torch.distributed as dist

    from reshard_ext.transports import outcome

    plan, out, want = _exchanging_plan(rank, world, seed=5)
    agree = outcome.agree
    if rank == 1:
        outcome.agree = lambda *a, **k: (time.sleep(4.0), agree(*a, **k))[1]
    t0 = time.monotonic()
    try:
        error = _error_of(rx.execute, plan, verify=True, timeout=1.5)
    finally:
        outcome.agree = agree
    elapsed = time.monotonic() - t0
    dist.barrier()
    rx.execute(plan, verify=True)
    return error, elapsed, bool(torch.equal(out, want))


def test_a_rank_late_to_the_check_raises_within_the_timeout():
    results = run_ranks(2, _late_to_the_check)
    for rank, (_, _, ok) in enumerate(results):
        assert ok, rank
    assert "rank 1 did not reach the end of the execute within 1.5 s" in results[0][0], results[0][0]
    # the late rank blames itself, not rank 0, which came in time and left
    late = results[1][0]
    assert "rank 0 did not wait for this rank" in late and "past the 1.5 s timeout" in late, late
    assert results[0][1] < 4.0, results[0][1]


def _abort_in_the_check(rank, world):
    """Rank 0 calls plan.abort() while it waits in the execute's outcome (which carries the
    digest check) for rank 1 (1.5 s late): the data has landed, so the outcome runs to its
    end. Then both execute again, verified."""
    import threading

    from reshard_ext.transports import outcome

    plan, out, want = _exchanging_plan(rank, world, seed=8)
    agree = outcome.agree

    def late_or_aborting(*a, **k):
        if rank == 1:
            time.sleep(1.5)
        else:
            threading.Timer(0.3, plan.abort).start()
        return agree(*a, **k)

    outcome.agree = late_or_aborting
    try:
        error = _error_of(rx.execute, plan, verify=True, version=1, timeout=20)
    finally:
        outcome.agree = agree
    version = plan.version
    error_next = _error_of(rx.execute, plan, verify=True, version=2, timeout=20)
    return error, version, error_next, plan.version, bool(torch.equal(out, want))


def test_abort_during_the_check_lets_it_finish():
    # An abort that cut the outcome short would tell the ranks different answers.
    for rank, result in enumerate(run_ranks(2, _abort_in_the_check)):
        assert result == ("", 1, "", 2, True), (rank, result)


def _checks_of_two_plans(rank, world):
    a, out_a, want_a = _exchanging_plan(rank, world, seed=6)
    b, out_b, want_b = _exchanging_plan(rank, world, seed=7)
    rx.execute(a)
    rx.execute(b)
    error = _error_of(rx.verify, a if rank == 0 else b)
    rx.verify(a)
    rx.verify(b)
    return error


def test_ranks_checking_different_plans_raise():
    for rank, error in enumerate(run_ranks(2, _checks_of_two_plans)):
        assert "the ranks ran different plans: [0] and [1]" in error, (rank, error)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU")])])
def test_lane_sums_on_the_device_equal_the_host_lanes(device):
    """The check's sum of digests left on the GPU (DeviceDigests) is the host's lane sum of
    sends minus receives mod 2^32, high bits set or not, and ignores slots of neither."""
    from reshard_ext.transports.digests import DeviceDigests, lanes

    rng = np.random.default_rng(5)
    send = rng.integers(0, 2**64, size=300, dtype=np.uint64, endpoint=False)
    recv = rng.integers(0, 2**64, size=200, dtype=np.uint64, endpoint=False)
    send[:3] = [2**64 - 1, 2**63, 2**32 - 1]
    other = rng.integers(0, 2**64, size=50, dtype=np.uint64, endpoint=False)
    buf = torch.from_numpy(np.concatenate((send, other, recv)).view(np.int64)).to(device)
    signs = torch.tensor([1] * 300 + [0] * 50 + [-1] * 200, dtype=torch.int64, device=device)
    got = DeviceDigests(buf, signs, lambda: (send, recv)).lane_difference().cpu().numpy()
    assert list(got % 2**32) == list((lanes(send) - lanes(recv)) % 2**32)
    same = DeviceDigests(torch.cat((buf[:300], buf[:300])), torch.tensor([1] * 300 + [-1] * 300, device=device),
                         lambda: (send, send))
    assert list(same.lane_difference().cpu().numpy() % 2**32) == [0, 0]


# ---- GPUs ------------------------------------------------------------------------------

NEEDS_2_GPUS = pytest.mark.skipif(not (gpus_for(2) and rx.build_info()["cuda"]),
                                  reason="needs 2 GPUs and reshard_ext built with CUDA")


@pytest.mark.gpu
@NEEDS_2_GPUS
@pytest.mark.parametrize("backend", ["nccl", "direct", "torch", "nvshmem"])
@pytest.mark.parametrize("max_batch_bytes", [None, 4096])
def test_verified_matrix_cuda(backend, max_batch_bytes):
    own_gpus(backend)
    run_ranks(2, verified, run_case, "two", "cuda", max_batch_bytes, backend, backend="nccl")


@pytest.mark.gpu
@NEEDS_2_GPUS
@pytest.mark.parametrize("rx_backend", ["nccl", "direct", "nvshmem"])
@pytest.mark.parametrize("where", ["receiver", "sender"])
def test_verified_mxfp8_cuda(where, rx_backend):
    """direct: the fp32 source lands in a BF16 staging the receiver quantizes afterwards;
    nvshmem: the NCCL path's boxes and digests around put-with-signal."""
    from test_mxfp8_refit import refit_worker

    for layout_kind in ("2d", "swizzled"):
        run_ranks(2, verified, refit_worker, where, layout_kind, "ceil", "cuda", 0, rx_backend, backend="nccl")


def _direct_cuda(rank, world):
    # every contiguous op is its own NCCL message
    return run_case(rank, world, "two", "cuda", None, "nccl", options=rx.Options(tuning=rx.Tuning(direct_bytes=1)))


@pytest.mark.gpu
@NEEDS_2_GPUS
def test_verified_direct_messages_cuda():
    run_ranks(2, verified, _direct_cuda, backend="nccl")


def _corrupt_one_round_cuda(rank, world, which):
    """NCCL: a 2 MiB tensor moved as one direct message, in verify rounds. A clean
    verified refit passes bit for bit; then rank 1 flips a bit of what lands in one round
    only (the first or the last), right after that round's transfer on its stream, and
    verify names the tensor on both ranks."""
    dev = gpu_of(rank)
    g = torch.Generator().manual_seed(4)
    full = torch.randn(1024, 512, generator=g).to(dev)
    s = rx.Layout((1024, 512), torch.float32, rx.Mesh([0]), [rx.Replicate()])
    d = rx.Layout((1024, 512), torch.float32, rx.Mesh([1]), [rx.Replicate()])
    dst = torch.zeros(1024, 512, device=dev)
    plan = rx.plan({"x": (full.clone(), s)} if rank == 0 else {}, {"x": (dst, d)} if rank == 1 else {},
                   options=rx.Options(tuning=rx.Tuning(direct_bytes=1 << 20)), backend="nccl")  # NCCL's verify rounds
    rx.execute(plan, verify=True)
    hit = []
    if rank == 1:
        assert torch.equal(dst, full.to(dev))
        begin, end = dst.data_ptr(), dst.data_ptr() + dst.numel() * 4

        def corrupting_post(b, r, side, recvs):  # the executor calls it after each post, on its thread
            for m in recvs:
                if begin <= m.ptr < end and (m.ptr == begin if which == "first" else m.ptr + m.bytes == end):
                    assert m.bytes < end - begin, "the direct message was not cut into rounds"
                    with torch.cuda.stream(torch.cuda.ExternalStream(side, device=dev)):
                        dst.view(torch.int32).view(-1)[(m.ptr - begin) // 4 + 7] ^= 4
                    hit.append(m.ptr)

        plan.transport.executor.set_post_hook(corrupting_post)
    try:
        rx.execute(plan, verify=True)
    except rx.ReshardError as e:
        return str(e), hit
    finally:
        if rank == 1:
            plan.transport.executor.set_post_hook(None)
    return None, hit


@pytest.mark.gpu
@NEEDS_2_GPUS
@pytest.mark.parametrize("which", ["first", "last"])
def test_execute_verify_catches_corruption_in_one_round_cuda(which):
    results = run_ranks(2, _corrupt_one_round_cuda, which, backend="nccl")
    assert len(results[1][1]) == 1, results
    for msg, _ in results:
        assert msg is not None and "'x'[0:1024, 0:512]" in msg and "from rank 0 to rank 1" in msg, msg


@pytest.mark.gpu
@NEEDS_2_GPUS
@pytest.mark.parametrize("target", [(1, "w"), (0, "w"), (1, "scale")], ids=["received", "copied", "mxfp8-scale"])
def test_verify_catches_a_changed_destination_cuda(target):
    victim = target[0]
    for msg in run_ranks(2, _corrupt_after_refit, "cuda", target, backend="nccl"):
        assert "rx.verify" in msg and f"rank {victim}" in msg, msg


def test_digest_kernel_sizes_are_whole_boxes():
    """The digest sums of a table are per box, in box order (what the transports index)."""
    x = torch.arange(64, dtype=torch.float32)
    y = torch.zeros(64)
    rows = [(x.data_ptr() + 4 * 16 * i, y.data_ptr() + 4 * 16 * i, (16,), (1,), (1,), code_of(x.dtype),
             code_of(y.dtype)) for i in range(4)]
    per_box = _C.digest_boxes_cpu(table(rows), int(_C.PASS_SRC))
    assert len(per_box) == 4 and len(set(per_box)) == 4
    assert per_box[2] == _C.digest_boxes_cpu(table(rows[2:3]), int(_C.PASS_SRC))[0]


def _landing_cuda(rank, world, groups):
    """48 tensors a direct pair moves both ways (column shards to row shards), every execute
    verified: each receiver digests a landing group as soon as its sender signals it, so
    a group read before it landed fails verify (the destinations start as NaN)."""
    dev = gpu_of(rank)
    g = torch.Generator().manual_seed(9)
    src, dst, want = {}, {}, {}
    for i in range(48):
        shape = (256 + 64 * (i % 5), 1024)
        full = torch.randn(shape, generator=g)
        s = rx.Layout(shape, torch.float32, rx.Mesh([0, 1]), [rx.Shard(1)])
        d = rx.Layout(shape, torch.float32, rx.Mesh([1, 0]), [rx.Shard(0)])
        src[f"t{i}"] = (s.local_part(full, rank).to(dev), s)
        dst[f"t{i}"] = (torch.full(d.local_shape(rank), float("nan"), device=dev), d)
        want[f"t{i}"] = d.local_part(full, rank)
    plan = rx.plan(src, dst, backend="direct", options=rx.Options(tuning=rx.Tuning(direct_verify_groups=groups)))
    for _ in range(3):
        rx.execute(plan, verify=True)
        ok = all(torch.equal(dst[n][0].cpu(), want[n]) for n in want)
        for t, _ in dst.values():
            t.fill_(float("nan"))
    return ok, plan.transport.direct_peers


@pytest.mark.gpu
@NEEDS_2_GPUS
@pytest.mark.parametrize("groups", [1, 8, 255])
def test_verified_direct_landing_groups_cuda(groups):
    for rank, (ok, peers) in enumerate(run_ranks(2, _landing_cuda, groups, backend="nccl")):
        assert ok and peers == [1 - rank], (rank, ok, peers)


def _corrupt_landed_cuda(rank, world):
    """A direct pair: rank 1 flips a bit of what rank 0 wrote into it, on its stream right
    after the landing wait and before the read pass: verify must name the piece on both
    ranks; a clean verified execute first."""
    dev = gpu_of(rank)
    full = torch.randn(64, 512, generator=torch.Generator().manual_seed(5))
    s = rx.Layout((64, 512), torch.float32, rx.Mesh([0, 1]), [rx.Shard(1)])
    d = rx.Layout((64, 512), torch.float32, rx.Mesh([1, 0]), [rx.Shard(0)])
    out = torch.zeros(d.local_shape(rank), device=dev)
    plan = rx.plan({"w": (s.local_part(full, rank).to(dev), s)}, {"w": (out, d)}, backend="direct")
    rx.execute(plan, verify=True, version=1)
    ok = torch.equal(out.cpu(), d.local_part(full, rank)) and plan.transport.direct_peers == [1 - rank]
    real = plan.transport.exec

    class Flip:
        def __getattr__(self, name):
            return getattr(real, name)

        def wait_landed(self, stream, k):
            real.wait_landed(stream, k)
            if rank == 1 and k == 0:  # one op per pair: landing group 0
                out.view(torch.int32)[7, 3] ^= 1  # rank 1 holds rows 0-31: one that rank 0 wrote

    plan.transport.exec = Flip()
    try:
        rx.execute(plan, verify=True, version=2)
        err = "no error"
    except rx.ReshardError as e:
        err = str(e)
    finally:
        plan.transport.exec = real
    return ok, err, plan.version


@pytest.mark.gpu
@NEEDS_2_GPUS
def test_direct_verify_catches_a_write_changed_after_landing_cuda():
    for rank, (ok, err, version) in enumerate(run_ranks(2, _corrupt_landed_cuda, backend="nccl")):
        assert ok, rank
        assert "'w'[0:32, 0:256] from rank 0 to rank 1" in err, (rank, err)
        assert version is None, (rank, version)


def _odd_direct_messages(rank, world):
    """Two direct messages back to back on one ring stream, the first an odd number of bf16
    elements: the second one's elements straddle the slots' edges unless chunks are cut at
    element-safe offsets of each message."""
    g = torch.Generator().manual_seed(5)
    full = {"a": torch.randn(65537, generator=g).to(torch.bfloat16), "b": torch.randn(70001, generator=g),
            "c": torch.randn(50003, generator=g).double()}
    lay = {k: (rx.Layout(tuple(v.shape), v.dtype, rx.Mesh([0]), [rx.Replicate()]),
               rx.Layout(tuple(v.shape), v.dtype, rx.Mesh([1]), [rx.Replicate()])) for k, v in full.items()}
    dst = {k: torch.zeros_like(v) for k, v in full.items()}
    plan = rx.plan({k: (v.clone(), lay[k][0]) for k, v in full.items()} if rank == 0 else {},
                   {k: (v, lay[k][1]) for k, v in dst.items()} if rank == 1 else {},
                   options=rx.Options(tuning=rx.Tuning(direct_bytes=1, host_ring=True)))
    for _ in range(2):
        rx.execute(plan, verify=True)
    return rank == 0 or all(torch.equal(dst[k], full[k]) for k in full)


def test_verified_direct_messages_of_any_length_share_a_ring_stream():
    assert run_ranks(2, _odd_direct_messages) == [True, True]
