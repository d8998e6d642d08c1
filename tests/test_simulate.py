"""`simulate`: the CLI, the model/spec parsing, and numbers checked against what the
layouts imply, computed here independently of the planner."""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import pytest
import torch

import reshard_ext.simulate as sim
from reshard_ext import _C, ReshardError
from reshard_ext.layout import Replicate, Shard
from reshard_ext.model_config import PRESETS, load_model, make_parallel, parse_spec, shape_from_hf_config
from reshard_ext.synthetic import LLAMA3_8B, ModelShape, Parallel, model_layouts, total_bytes

TINY_MOE = ModelShape(layers=4, hidden=128, ffn=256, heads=8, kv_heads=8, vocab=512, head_dim=16,
                      experts=8, moe_ffn=64, first_dense_layers=1, shared_expert_ffn=64,
                      q_lora_rank=32, kv_lora_rank=16, rope_head_dim=8)
LINK = sim.LinkModel(gpus_per_node=2, nvlink_gbps=100.0, network_gbps=10.0, copy_gbps=1000.0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="simulate")
    sim.add_arguments(p)
    return p


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = sim.run(_parser().parse_args(argv + ["--no-progress"]))
    out = capsys.readouterr()
    return code, out.out, out.err


def _local_bytes(layouts: dict, world: int) -> list[int]:
    """Bytes of every rank's pieces, from the reference semantics (Layout.local_shape)."""
    out = [0] * world
    for lay in layouts.values():
        elem = torch.empty((), dtype=lay.dtype).element_size()
        for r in set(lay.mesh.ranks):
            out[r] += math.prod(lay.local_shape(r)) * elem
    return out


def test_help_documents_every_option():
    p = _parser()
    text = " ".join(p.format_help().split())
    for action in p._actions:
        if action.dest == "help":
            continue
        assert action.help and action.help != argparse.SUPPRESS, action.dest
        for opt in action.option_strings:
            assert opt in text
    for phrase in ("busiest port", "modelled", "NVLink", "network", "ep defaults to tp", *PRESETS):
        assert phrase in text, phrase
    # and through the module's own entry point
    res = subprocess.run([sys.executable, "-m", "reshard_ext.simulate", "--help"], check=False, capture_output=True,
                         text=True)
    assert res.returncode == 0 and "--network-gbps" in res.stdout


@pytest.mark.parametrize("src,dst,gpus,separate", [
    (Parallel(tp=2, pp=2, dp=2, ep=2), Parallel(tp=4, dp=2, ep=4), 8, False),
    (Parallel(tp=1, pp=2, dp=4, ep=4), Parallel(tp=2, dp=3, ep=2, offset=8), 8, True),
    (Parallel(tp=2, dp=1, ep=1), Parallel(tp=1, dp=4, ep=4, offset=2), 2, True),
])
def test_bytes_match_the_layouts(src, dst, gpus, separate):
    rep = sim.simulate(TINY_MOE, src, dst, LINK, max_batch_bytes=1 << 16, keep_phases=True)
    world = rep["world"]
    assert world == max(src.offset + src.world, dst.offset + dst.world)
    ranks = rep["ranks"]
    dst_bytes = _local_bytes(model_layouts(TINY_MOE, dst), world)
    for r in range(world):  # what a rank receives or copies is exactly its dst pieces
        assert ranks["received"][r] + ranks["copied"][r] == dst_bytes[r], r
    assert sum(ranks["sent"]) == sum(ranks["received"]) == rep["totals"]["sent"] == rep["totals"]["received"]
    src_bytes = _local_bytes(model_layouts(TINY_MOE, src), world)
    for r in range(world):  # a rank copies only what it holds
        assert ranks["copied"][r] <= min(src_bytes[r], dst_bytes[r])
    direct = rep["_phases"]["without_relays"][0].load
    col = {p: i for i, p in enumerate(sim.PORTS)}
    for r in range(world):
        assert direct[r][col["nvlink_out"]] + direct[r][col["network_out"]] == ranks["sent"][r]
        assert direct[r][col["nvlink_in"]] + direct[r][col["network_in"]] == ranks["received"][r]
        assert direct[r][col["copy"]] == ranks["copied"][r]
    # relays change who sends, not what each rank ends up receiving
    scatter, forward = (ph.load for ph in rep["_phases"]["with_relays"])
    for r in range(world):
        got = sum(ph[r][col["nvlink_in"]] + ph[r][col["network_in"]] for ph in (scatter, forward))
        assert got == pytest.approx(ranks["received"][r], rel=1e-12, abs=1e-6)
        sent_once = scatter[r][col["nvlink_out"]] + scatter[r][col["network_out"]]
        assert sent_once <= ranks["sent"][r] + 1e-6
    assert rep["planning"]["batches"] >= 1 and min(ranks["staging"]) >= 0


def test_pipelined_relay_by_hand():
    """The same 1 -> 4 fan-out in 4 relay stages: the first stage scatters a quarter, three
    stages each scatter a quarter while receivers forward the previous one (every port
    busy with one model's worth over the three), the last forwards the last quarter."""
    model = total_bytes(model_layouts(LLAMA3_8B, Parallel()))
    link = sim.LinkModel(gpus_per_node=1, nvlink_gbps=400.0, network_gbps=50.0)
    rep = sim.simulate(LLAMA3_8B, Parallel(), Parallel(dp=4, offset=1), link, max_batch_bytes=0, relay_stages=4)
    net = link.network_gbps * 1e9
    p = rep["prediction"]["with_relays_pipelined"]
    assert p["stages"] == 4 and p["faster"]
    assert [ph["seconds"] for ph in p["phases"]] == pytest.approx([model / net / 4, 0.75 * model / net,
                                                                   0.75 * model / net / 4])
    assert p["seconds"] < rep["prediction"]["with_relays"]["seconds"]


def test_predicted_times_by_hand():
    """Llama-3-8B from one GPU to four replicas on four other nodes: without relays the
    source sends the model four times over its network port; with relays once, then each
    receiver forwards three quarters of it."""
    model = total_bytes(model_layouts(LLAMA3_8B, Parallel()))
    link = sim.LinkModel(gpus_per_node=1, nvlink_gbps=400.0, network_gbps=50.0)
    rep = sim.simulate(LLAMA3_8B, Parallel(), Parallel(dp=4, offset=1), link, max_batch_bytes=0)
    net = link.network_gbps * 1e9
    assert rep["prediction"]["without_relays"]["seconds"] == pytest.approx(4 * model / net)
    phases = {p["name"]: p["seconds"] for p in rep["prediction"]["with_relays"]["phases"]}
    assert phases["scatter"] == pytest.approx(model / net)
    assert phases["forward"] == pytest.approx(0.75 * model / net)
    assert rep["busiest_ports"][0] == {"rank": 0, "node": 0, "port": "network_out", "bytes": 4 * model,
                                       "seconds": pytest.approx(4 * model / net)}
    # TP2 -> TP1 collocated on one node: each GPU swaps half the model with the other over NVLink
    link = sim.LinkModel(gpus_per_node=8, nvlink_gbps=400.0)
    rep = sim.simulate(LLAMA3_8B, Parallel(tp=2), Parallel(dp=2), link, max_batch_bytes=0)
    half = sum(total_bytes({n: l}) for n, l in model_layouts(LLAMA3_8B, Parallel()).items()) / 2
    assert rep["per_rank"]["nvlink_out"]["max"] == pytest.approx(half, rel=1e-3)
    assert rep["prediction"]["without_relays"]["seconds"] == pytest.approx(
        max(rep["per_rank"]["nvlink_out"]["max"] / 400e9, rep["per_rank"]["copied"]["max"] / link.copy_gbps / 1e9))


def test_staging_matches_the_assigned_batches():
    """The dry-run batch layout (RankPlan.batch_bytes) sizes staging exactly as the
    plan's batches do once assigned."""
    src = model_layouts(TINY_MOE, Parallel(tp=2, pp=2, dp=2, ep=2))
    dst = model_layouts(TINY_MOE, Parallel(tp=4, dp=2, ep=4))
    st = _C.LayoutTable([(n, l._c) for n, l in src.items()])
    dt = _C.LayoutTable([(n, l._c) for n, l in dst.items()])
    for rank in range(8):
        for mbb, k in ((0, 1), (1 << 14, 2), (1 << 14, 3), (1 << 12, 9)):
            p = _C.plan_rank(st, dt, rank, mbb)
            dry = p.batch_bytes(k)
            p.assign_batches(k)
            tables = _C.ExecTables(p)
            assert len(dry) == k == tables.num_batches
            assert max(s for s, _ in dry) == tables.send_buffer_bytes
            assert max(r for _, r in dry) == tables.recv_buffer_bytes
            assert p.batch_bytes(k) == dry  # cutting again for the same k changes nothing


def test_staging_as_the_gpu_transport_allocates():
    """Per rank: the largest batch's send and receive buffers, twice when batches
    pipeline (transports/cuda.py), at the batch count every rank agrees on."""
    src = model_layouts(TINY_MOE, Parallel(tp=2, pp=2, dp=2, ep=2))
    dst = model_layouts(TINY_MOE, Parallel(tp=4, dp=2, ep=4))
    st = _C.LayoutTable([(n, l._c) for n, l in src.items()])
    dt = _C.LayoutTable([(n, l._c) for n, l in dst.items()])
    for mbb, seed in ((0, 16), (1 << 14, 16), (1 << 14, 0)):  # no seed: ranks staged too early are redone
        planned = sim.plan_all_ranks(st, dt, 8, mbb, seed_ranks=seed)
        k = max(_C.plan_rank(st, dt, r, mbb).wanted_batches() for r in range(8))
        assert planned.batches == k and (k > 1) == (mbb > 0)
        for rank in range(8):
            p = _C.plan_rank(st, dt, rank, mbb)
            p.assign_batches(k)
            tables = _C.ExecTables(p)
            want = (2 if k > 1 else 1) * (tables.send_buffer_bytes + tables.recv_buffer_bytes)
            assert planned.staging[rank] == want


def test_fanout_groups_identical_boxes():
    src = model_layouts(LLAMA3_8B, Parallel(tp=2))
    dst = model_layouts(LLAMA3_8B, Parallel(tp=1, dp=3, offset=2))
    st = _C.LayoutTable([(n, l._c) for n, l in src.items()])
    dt = _C.LayoutTable([(n, l._c) for n, l in dst.items()])
    sharded = _local_bytes({n: l for n, l in src.items() if any(isinstance(x, Shard) for x in l.placements)}, 2)
    replicated = total_bytes({n: l for n, l in src.items() if all(isinstance(x, Replicate) for x in l.placements)})
    # each TP half goes to all three replicas; the three take the replicated norms from
    # the two holders in turn
    want = {0: {(2, 3, 4): sharded[0], (2, 4): replicated}, 1: {(2, 3, 4): sharded[1], (3,): replicated}}
    for rank in (0, 1):
        p = _C.plan_rank(st, dt, rank, 0)
        sizes, nbytes, flat = p.fanout()
        groups, at = {}, 0
        for n, b in zip(sizes, nbytes):
            groups[tuple(flat[at:at + n])] = b
            at += n
        assert at == len(flat) and groups == want[rank]
        assert sum(len(r) * b for r, b in groups.items()) == p.send_total()
        peers, sent = p.send_pairs()
        assert dict(zip(peers, sent)) == {r: sum(b for g, b in groups.items() if r in g) for r in (2, 3, 4)}


def test_json_output_parses(capsys):
    code, out, _ = _run(["--model", "llama-3-8b", "--src", "tp=2", "--dst", "tp=1", "--gpus", "4", "--json"], capsys)
    assert code == 0
    rep = json.loads(out)
    assert rep["world"] == 4 and rep["model"]["name"] == "llama-3-8b"
    assert rep["totals"]["sent"] == rep["totals"]["received"] > 0
    assert rep["prediction"]["with_relays"]["modelled"] is True
    assert len(rep["ranks"]["staging"]) == 4


def test_table_output_and_reference(capsys):
    code, out, _ = _run(["--model", "llama-3-8b", "--gpus", "2"], capsys)
    assert code == 0
    for text in ("per rank", "busiest ports", "without relays", "with relays", "staging memory"):
        assert text in out
    # the headline case prints the published measurement beside the prediction
    ref = sim.REFERENCES[0]
    assert ref.src == make_parallel(parse_spec(PRESETS["deepseek-v3"].src), PRESETS["deepseek-v3"].shape, 256, 0, "")
    assert ref.dst == make_parallel(parse_spec(PRESETS["deepseek-v3"].dst), PRESETS["deepseek-v3"].shape, 256, 0, "")


def test_plot_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "refit.png"
    code, _, _ = _run(["--model", "llama-3-8b", "--gpus", "4", "--gpus-per-node", "2", "--plot", str(png)], capsys)
    assert code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hf_config_path(tmp_path, capsys):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
           "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, _ = _run(["--model", str(tmp_path), "--src", "tp=2", "--dst", "tp=1", "--gpus", "2", "--json"], capsys)
    assert code == 0
    rep = json.loads(out)
    # embedding + output 2 x 256x64, final norm 64; per layer: qkv (64 + 2*32) x 64 and its
    # norm 64, proj 64x64, fc1 2*128 x 64 and its norm 64, fc2 64x128
    per_layer = 128 * 64 + 64 + 64 * 64 + 256 * 64 + 64 + 64 * 128
    assert rep["model"]["parameters"] == 2 * 256 * 64 + 64 + 2 * per_layer
    assert rep["model"]["bytes"] == 2 * rep["model"]["parameters"]


def test_hf_moe_config():
    cfg = {"hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
           "intermediate_size": 18432, "vocab_size": 129280, "n_routed_experts": 256, "moe_intermediate_size": 2048,
           "n_shared_experts": 1, "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "topk_method": "noaux_tc"}
    assert shape_from_hf_config(cfg) == PRESETS["deepseek-v3"].shape
    two_shared = shape_from_hf_config({**cfg, "n_shared_experts": 2, "topk_method": "greedy"})
    assert two_shared.shared_expert_ffn == 2 * 2048 and not two_shared.router_bias
    qwen = {"hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
            "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "num_experts": 128,
            "moe_intermediate_size": 1536}
    assert shape_from_hf_config(qwen) == PRESETS["qwen3-235b-a22b"].shape


def test_user_errors(tmp_path, capsys):
    for argv in (["--model", "no-such-model"], ["--src", "tp=0"], ["--src", "tq=2"], ["--dst", "tp=2,tp=4"],
                 ["--model", "llama-3-8b", "--src", "ep=2"], ["--model", "deepseek-v3", "--src", "ep=7"],
                 ["--model", "llama-3-8b", "--src", "tp=3", "--gpus", "8"]):
        code, _, err = _run(argv, capsys)
        assert code == 2 and err.startswith("simulate: "), argv
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ReshardError, match="not valid JSON"):
        load_model(str(bad))
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ReshardError, match="num_attention_heads"):
        load_model(str(bad))


@pytest.mark.parametrize("argv", [["--gpus", "0"], ["--copy-gbps", "inf"], ["--network-gbps", "0"],
                                  ["--nvlink-gbps", "nan"], ["--batch-mb", "-1"], ["--gpus-per-node", "x"]])
def test_bad_numbers_are_usage_errors(argv, capsys):
    """Not a silent default (--gpus 0 planned 8 GPUs) nor a prediction of 0 s (--copy-gbps inf)."""
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(argv)
    assert e.value.code == 2 and f"argument {argv[0]}" in capsys.readouterr().err


_GOOD = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128}


@pytest.mark.parametrize("config", [[], "a string", dict(_GOOD, hidden_size="abc"), dict(_GOOD, num_hidden_layers=-2),
                                    dict(_GOOD, vocab_size=None), dict(_GOOD, intermediate_size=1.5),
                                    dict(_GOOD, num_experts=True)], ids=str)
def test_malformed_configs_are_errors_in_words(tmp_path, capsys, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, _, err = _run(["--model", str(path)], capsys)
    assert code == 2 and err.startswith("simulate: config.json"), err


def test_presets_resolve():
    for name, preset in PRESETS.items():
        key, shape, got = load_model(name.upper().replace("-", "_"))
        assert key == name and got is preset and shape is preset.shape
        src = make_parallel(parse_spec(preset.src), shape, preset.gpus, 0, "--src")
        dst = make_parallel(parse_spec(preset.dst), shape, preset.gpus, 0, "--dst")
        assert src.world == dst.world == preset.gpus


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_small(name):
    """Every preset's real shape, planned on a few ranks; per-rank bytes as the layouts imply."""
    shape = PRESETS[name].shape
    src = Parallel(tp=2, pp=2, dp=2, ep=2 if shape.experts else 1)
    dst = Parallel(tp=4, dp=2, ep=4 if shape.experts else 1)
    rep = sim.simulate(shape, src, dst, sim.LinkModel(gpus_per_node=4), model_name=name)
    dst_bytes = _local_bytes(model_layouts(shape, dst), 8)
    got = [a + b for a, b in zip(rep["ranks"]["received"], rep["ranks"]["copied"])]
    assert got == dst_bytes
    assert rep["totals"]["sent"] == rep["totals"]["received"]
    assert rep["model"]["bytes"] == total_bytes(model_layouts(shape, Parallel()))


def test_llama_at_2048_ranks():
    """The largest preset run the test suite affords: 2,048 ranks."""
    rep = sim.simulate(LLAMA3_8B, Parallel(tp=2, dp=1024), Parallel(tp=1, dp=2048), sim.LinkModel())
    assert rep["world"] == 2048
    # every rank copies what it holds (TP rank r % 2) and receives the rest of the model
    model = total_bytes(model_layouts(LLAMA3_8B, Parallel()))
    held = _local_bytes(model_layouts(LLAMA3_8B, Parallel(tp=2)), 2)
    assert rep["ranks"]["copied"] == [held[r % 2] for r in range(2048)]
    assert rep["ranks"]["received"] == [model - held[r % 2] for r in range(2048)]
    assert rep["totals"]["sent"] == rep["totals"]["received"]
    # one node of 8 GPUs swaps within itself: NVLink only
    assert rep["per_rank"]["network_in"]["max"] == 0 and rep["prediction"]["without_relays"]["seconds"] > 0


def test_help_says_each_default_once():
    text = _parser().format_help()
    assert "(default: None)" not in text and "(default: False)" not in text, text
    for line in " ".join(text.split()).split(" --"):
        assert line.count("default") <= 1, line


def test_table_names_the_schedules_as_rx_plan_runs_them(capsys):
    code, out, _ = _run(["--model", "llama-3-8b", "--gpus", "2"], capsys)
    assert code == 0
    assert "the planner today" not in out  # rx.plan relays by default
    assert "without relays (relay=False)" in out and "with relays in one stage (relay_stages=1)" in out
    assert "stages (as rx.plan stages them)" in out
    code, out, _ = _run(["--model", "llama-3-8b", "--gpus", "2", "--relay-stages", "3"], capsys)
    assert "with relays in 3 stages" in out and "as rx.plan stages them" not in out


def test_plots_one_question_each_without_offset_axes(tmp_path, capsys, monkeypatch):
    """Two PNGs (time per phase; bytes per rank and port). Every rank carries the same bytes
    here, which matplotlib would print as an offset ("+8.03") over ticks that make equal
    values look different: the axis starts at zero, with plain ticks, and the legends sit
    outside the data."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    figures: list = []
    save = Figure.savefig

    def keep(fig, path, *a, **k):
        fig.canvas.draw()
        figures.append(fig)
        return save(fig, path, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    png = tmp_path / "refit.png"
    code, out, _ = _run(["--model", "llama-3-8b", "--gpus", "4", "--gpus-per-node", "2", "--plot", str(png)], capsys)
    assert code == 0
    ports = tmp_path / "refit-ports.png"
    for path in (png, ports):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(ports) in out
    assert len(figures) == 2
    for fig in figures:
        for ax in fig.axes:
            assert ax.yaxis.get_major_formatter().get_offset() == "", ax.get_title()
            assert ax.xaxis.get_major_formatter().get_offset() == "", ax.get_title()
    load_axes = figures[1].axes
    assert all(ax.get_ylim()[0] == 0 for ax in load_axes)
    for fig in figures:
        for legend in [ax.get_legend() for ax in fig.axes if ax.get_legend()]:
            box = legend.get_window_extent()
            for ax in fig.axes:  # the legend box leaves every plotting area free
                assert not box.overlaps(ax.get_window_extent()), ax.get_title()
