"""scripts/nvshmem_sequence_probe.py (issue #37 item 5's diagnostic): its variants, the
verdict it draws from the ranks' reports (CPU), and on 2 GPUs that what it reads after an
NVSHMEM execute (peer mappings, signal words, stream state) is what the execute did."""
from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch
from _dist import run_ranks

_PATH = os.path.join(os.path.dirname(__file__), "..", "scripts", "nvshmem_sequence_probe.py")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _probe() -> Any:
    spec = importlib.util.spec_from_file_location("nvshmem_sequence_probe", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_variants_parse() -> None:
    probe = _probe()
    assert probe.parse_variants(probe.DEFAULT_VARIANTS)[0] == (["auto", "nccl", "nvshmem"], {})
    assert probe.parse_variants(" nvshmem ; nccl,nvshmem@NVSHMEM_DISABLE_CUDA_VMM=1,X=2 ;") == [
        (["nvshmem"], {}), (["nccl", "nvshmem"], {"NVSHMEM_DISABLE_CUDA_VMM": "1", "X": "2"})]
    for bad in ("nccl,carrier", "@X=1", "nvshmem@X"):
        with pytest.raises(ValueError):
            probe.parse_variants(bad)


def _step(backend: str, ok: bool = True, error: str | None = None) -> dict:
    return {"backend": backend, "step": 0, "ok": ok, "took": 20.0 if error else 0.1, "error": error}


def _reports(sender: dict | None = None, receiver: dict | None = None) -> list[dict]:
    """A failed NVSHMEM execute of TP1 -> TP1 in 2 batches: rank 0 sends, rank 1 receives.
    Each probe starts from what a transfer that completed leaves; the arguments override it."""
    steps = [_step("auto"), _step("nccl"), _step("nvshmem", False, "ReshardError: ... waited 20 s ...")]
    base = {"init_status": 2, "mapped": {0: True, 1: True}, "geometry": (2, 1 << 29, 1 << 30), "region": 1 << 40,
            "free_words": [0, 0], "batches": 2, "stream_idle": True}
    s = {**base, "pe": 0, "sends_to": {1: 2}, "expected_from": {}, "data_words": [0, 0], **(sender or {})}
    r = {**base, "pe": 1, "sends_to": {}, "expected_from": {0: 2}, "data_words": [2, 0], **(receiver or {})}
    return [{"rank": k, "steps": steps, "stage": "done", "finished": True, "nvshmem": p} for k, p in enumerate((s, r))]


def _verdict(reports: list) -> str:
    return "\n".join(_probe().diagnose(reports))


def test_a_clean_sequence_says_so() -> None:
    ok = [{"rank": k, "steps": [_step("auto"), _step("nvshmem")], "stage": "done", "finished": True} for k in (0, 1)]
    assert _verdict(ok) == "every execute of the sequence landed bit for bit: this variant does not hang"


def test_each_hypothesis_has_its_verdict() -> None:
    # H1: the sender's NVSHMEM does not map the receiver: its puts take the proxy path
    text = _verdict(_reports(sender={"mapped": {0: True, 1: False}}, receiver={"data_words": [0, 0],
                                                                              "stream_idle": False}))
    assert "H1 CONFIRMED: rank 0's NVSHMEM does not map PEs [1]" in text, text
    # H2: the sender's stream drained (its puts ran), the receiver counts nothing
    text = _verdict(_reports(receiver={"data_words": [0, 0], "stream_idle": False}))
    assert "H2: receiver rank 1 counts 0 of 2 messages from PE 0, though the sender's stream drained" in text, text
    assert "H1" not in text and "H3" not in text and "H4" not in text, text
    # H2 confirmed outright: the ranks' regions differ
    text = _verdict(_reports(receiver={"geometry": (2, 1 << 29, (1 << 30) + 16), "data_words": [0, 0]}))
    assert "H2 CONFIRMED: the ranks' regions differ" in text, text
    # H3: the sender's stream never drained: its puts never ran
    text = _verdict(_reports(sender={"stream_idle": False}, receiver={"data_words": [0, 0], "stream_idle": False}))
    assert "H3: sender rank 0's caller stream never drained" in text, text
    assert "they were never put" in text and "H2" not in text, text
    # H4: every signal landed, the receiver's stream wait never released
    text = _verdict(_reports(receiver={"stream_idle": False}))
    assert "H4: receiver rank 1 holds all 2 signals from PE 0" in text, text
    # the GPU work finished: a host-side failure
    text = _verdict(_reports())
    assert "the failure is on the host" in text and "H" not in text.replace("ReshardError", ""), text


def test_ranks_that_hang_on_the_host_are_named() -> None:
    reports: list = _reports()
    reports[1] = {**reports[1], "finished": False, "stage": "rx.plan backend=nvshmem", "nvshmem": None}
    text = _verdict([None, reports[1]])
    assert "ranks [0] reported nothing" in text, text
    assert "rank 1 never finished (last stage: rx.plan backend=nvshmem)" in text, text


# --- 2 GPUs: the probe reads what an execute did -----------------------------------------

def _probe_after_a_good_execute(rank: int, world: int) -> dict:
    import reshard_ext as rx

    shape = (1024, 512)
    src_l = rx.Layout(shape, torch.bfloat16, rx.Mesh([0]), [rx.Replicate()])
    dst_l = rx.Layout(shape, torch.bfloat16, rx.Mesh([1]), [rx.Replicate()])
    g = torch.randn(shape).to(torch.bfloat16).cuda()
    src = {"w": (g, src_l)} if rank == 0 else {}
    dst = {"w": (torch.zeros(shape, dtype=torch.bfloat16, device="cuda"), dst_l)} if rank == 1 else {}
    p = rx.plan(src, dst, backend="nvshmem")
    for _ in range(2):
        rx.execute(p)
    torch.cuda.synchronize()
    found = _probe()._nvshmem_probe(p, _probe()._Reader(), 2)
    found["landed"] = rank == 0 or bool(torch.equal(dst["w"][0], g))
    return found


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.gpu
def test_the_probe_reads_what_an_execute_did_2gpu() -> None:
    """A one-way NVSHMEM plan executed twice: both ranks map each other, the receiver
    counts 2 messages from PE 0, both streams are idle, the geometry agrees; and the verdict
    of that state (had the execute failed) is a host-side one, no H1-H4."""
    sender, receiver = run_ranks(2, _probe_after_a_good_execute, backend="nccl")
    assert sender["mapped"] == {0: True, 1: True} and receiver["mapped"] == {0: True, 1: True}, (sender, receiver)
    assert sender["sends_to"] == {1: 1} and receiver["expected_from"] == {0: 2}, (sender, receiver)
    assert receiver["data_words"] == [2, 0] and receiver["landed"], receiver
    assert sender["stream_idle"] and receiver["stream_idle"] and sender["geometry"] == receiver["geometry"]
    reports = [{"rank": k, "steps": [_step("nvshmem", False, "x")], "stage": "done", "finished": True, "nvshmem": p}
               for k, p in enumerate((sender, receiver))]
    assert "the failure is on the host" in _verdict(reports)
