"""What tools see of the package: version, typing, exceptions, reprs, options, license."""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

import reshard_ext as rx
from reshard_ext import options

PKG = Path(rx.__file__).parent
USER_SCRIPT = '''
from __future__ import annotations

import torch
import torch.distributed as dist

import reshard_ext as rx


def refit(piece: torch.Tensor, out: torch.Tensor) -> int:
    tp2 = rx.Layout((4096, 1024), torch.bfloat16, rx.Mesh([0, 1]), [rx.Shard(0)])
    tp4 = rx.Layout((4096, 1024), torch.bfloat16, rx.Mesh([0, 1, 2, 3]), [rx.Shard(-1, stride=1)])
    rank = dist.get_rank()
    src = {"w": (piece, tp2)} if rank < 2 else {}
    shape: tuple[int, ...] | None = tp4.local_shape(rank)
    plan: rx.Plan = rx.plan(src, {"w": (out, tp4)}, max_batch_bytes=1 << 20, options=rx.Options(timeout=30.0))
    rx.execute(plan)
    sends, recvs, copies = plan.num_ops
    ops: rx.RankPlan = rx.local_plan({"w": tp2}, {"w": tp4}, rank)
    info: dict[str, object] = rx.build_info()
    version: str = rx.__version__
    try:
        rx.plan(None, None)
    except rx.ReshardError as e:
        print(str(e), info, version, shape)
    return sends + recvs + copies + len(ops.sends) + plan.num_batches


def swap(a: torch.nn.Module, b: torch.nn.Module) -> None:
    rx.swap_model_weights(a, b, transform=rx.MXFP8(params=["w"], scale_layout="2d"))
    rx.execute(rx.prepare_swap_model_weights(a, b))
'''


def test_version_is_the_distribution_version() -> None:
    try:
        dist_version = importlib.metadata.version("reshard_ext")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("running from a source tree, not an installed distribution")
    assert rx.__version__ == dist_version


def test_typed_package_ships_its_markers() -> None:
    assert (PKG / "py.typed").exists()
    assert (PKG / "_C.pyi").exists()


@pytest.mark.skipif(shutil.which("mypy") is None and importlib.util.find_spec("mypy") is None,
                    reason="mypy not installed")
def test_user_script_passes_mypy_strict(tmp_path: Path) -> None:
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT)
    env = dict(os.environ)
    if "site-packages" not in PKG.parts:  # a source tree: point mypy at it
        env.update(PYTHONPATH=str(PKG.parent), MYPYPATH=str(PKG.parent))
    # One cache for both runs: the second checks the changed script alone, not torch and the package again.
    mypy = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / ".mypy_cache"), str(script)]
    r = subprocess.run(mypy, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    # and mypy does see the package's types: a wrong call is an error
    script.write_text(USER_SCRIPT + "\nrx.execute(1)\n")
    r = subprocess.run(mypy, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 1 and 'incompatible type "int"; expected "Plan"' in r.stdout, r.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("nm") is None, reason="needs Linux and nm")
def test_extension_exports_only_its_init_function() -> None:
    # Exported std:: or rx symbols could interpose on (or be interposed by) torch's copies.
    so = rx._C.__file__
    assert so is not None
    # Global and weak ones only: the version script leaves some linkers a LOCAL entry, which binds nothing.
    out = subprocess.run(["nm", "-D", "--defined-only", "--extern-only", so], capture_output=True, text=True,
                         check=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert names == ["PyInit__C"], names[:20]


def test_unbuilt_sources_say_the_extension_is_not_built(tmp_path: Path) -> None:
    # The package's Python files without _C: what `python` in a fresh clone's root imports.
    shutil.copytree(PKG, tmp_path / "reshard_ext", ignore=shutil.ignore_patterns("_C*.so", "_C*.pyd", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", "import reshard_ext"], cwd=tmp_path, capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: reshard_ext's compiled extension _C is not built"), r.stderr
    assert "pip install" in last and "circular import" not in r.stderr, r.stderr
    # a built extension that fails to load keeps the loader's own message
    (tmp_path / "reshard_ext" / Path(rx._C.__file__ or "_C.so").name).write_bytes(b"not an ELF file")
    r = subprocess.run([sys.executable, "-c", "import reshard_ext"], cwd=tmp_path, capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode != 0 and "not built" not in r.stderr, r.stderr


def test_exceptions_print_under_the_package_name() -> None:
    try:
        raise rx.ReshardError("boom")
    except rx.ReshardError as e:
        assert traceback.format_exception_only(type(e), e)[-1].strip() == "reshard_ext.ReshardError: boom"
    assert rx.ReshardError.__module__ == rx.InternalError.__module__ == "reshard_ext"
    assert issubclass(rx.ReshardError, RuntimeError)


def test_layout_repr_is_one_style() -> None:
    lay = rx.Layout((8,), torch.bfloat16, rx.Mesh([[0, 1], [2, 3]]),
                    [rx.Replicate(), rx.Shard(0, stride=2, blocks=(4, 4))])
    text = ("Layout(shape=(8,), dtype=torch.bfloat16, mesh=Mesh(shape=(2, 2), ranks=[0, 1, 2, 3]), "
            "placements=[Replicate(), Shard(0, stride=2, blocks=(4, 4))])")
    assert repr(lay) == text == lay._c.describe()
    assert repr(lay.mesh) == "Mesh(shape=(2, 2), ranks=[0, 1, 2, 3])"
    assert repr(rx.Shard(1)) == "Shard(1)" and repr(rx.Replicate()) == "Replicate()"
    # the text rx.plan's errors use (decoded from the metadata exchange) is the same repr
    with pytest.raises(rx.ReshardError) as e:
        rx.local_plan({"w": rx.Layout((8,), torch.float32, rx.Mesh([0]), [rx.Replicate()])},
                      {"w": rx.Layout((4,), torch.float32, rx.Mesh([0]), [rx.Replicate()])}, 0)
    assert "Layout(shape=(8,), dtype=torch.float32, mesh=Mesh(shape=(1,), ranks=[0]), placements=[Replicate()])" \
        in str(e.value)


def test_negative_shard_dims_count_from_the_end() -> None:
    lay = rx.Layout((8, 4), torch.float32, rx.Mesh([0, 1]), [rx.Shard(-1)])
    assert lay.local_shape(0) == (8, 2)
    assert lay.placements == (rx.Shard(1),)
    assert lay == rx.Layout((8, 4), torch.float32, rx.Mesh([0, 1]), [rx.Shard(1)])
    g = torch.arange(32.0).reshape(8, 4)
    assert torch.equal(lay.local_part(g, 1), g[:, 2:])


@pytest.mark.parametrize("dim", [2, -3, 100])
def test_out_of_range_shard_dim_is_an_error(dim: int) -> None:
    with pytest.raises(rx.ReshardError, match=rf"Shard\({dim}\) of a 2-d tensor"):
        rx.Layout((8, 4), torch.float32, rx.Mesh([0, 1]), [rx.Shard(dim)])


@pytest.mark.parametrize("bad", [0.5, "0", None, True])
def test_non_integer_shard_dim_is_a_reshard_error(bad: object) -> None:
    with pytest.raises(rx.ReshardError, match="dim must be an integer"):
        rx.Shard(bad)  # type: ignore[arg-type]
    with pytest.raises(rx.ReshardError, match="stride must be an integer >= 1"):
        rx.Shard(0, stride=0)


@pytest.fixture
def fresh_env():
    options.reload_environment()
    yield
    options.reload_environment()


@pytest.mark.parametrize("name,value,why", [
    ("RESHARD_EXT_TIMEOUT", "10m", "expected a number of seconds"),
    ("RESHARD_EXT_NCCL_TIMEOUT", "-1", "> 0"),
    ("RESHARD_EXT_CUDA_BATCH_BYTES", "lots", "expected an integer"),
    ("RESHARD_EXT_CUDA_DIRECT_BYTES", "-5", "at least 0"),
    ("RESHARD_EXT_NCCL_REGISTER", "maybe", "expected 0 or 1"),
    ("RESHARD_EXT_CUDA_MAX_BLOCKS", "half", "expected an integer"),
])
def test_bad_environment_values_name_the_variable(monkeypatch, fresh_env, name: str, value: str, why: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(rx.ReshardError) as e:
        options.env_default(name)
    assert name in str(e.value) and repr(value) in str(e.value) and why in str(e.value)


def test_environment_values_parse(monkeypatch, fresh_env) -> None:
    monkeypatch.setenv("RESHARD_EXT_CUDA_BATCH_BYTES", "256M")
    monkeypatch.setenv("RESHARD_EXT_TIMEOUT", "2.5")
    monkeypatch.setenv("RESHARD_EXT_NCCL_REGISTER", "0")
    monkeypatch.setenv("RESHARD_EXT_CUDA_MAX_BLOCKS", "auto")
    o = rx.Options()
    assert o.resolved_batch_bytes() == 256 << 20
    assert o.resolved_timeout("gloo") == 2.5
    assert o.resolved_nccl_register() is False
    assert o.resolved_max_blocks() is None
    assert rx.Options(timeout=7, tuning=rx.Tuning(max_blocks=0)).resolved_timeout("nccl") == 7.0  # explicit fields win


def test_the_readme_points_at_the_knob_reference() -> None:
    # every variable is in the generated knob reference (tests/test_docs.py checks the built page)
    readme = PKG.parent / "README.md"
    if not readme.exists():
        pytest.skip("installed package: no README beside it")
    assert "(docs/reference/knobs.md)" in readme.read_text()
    assert (PKG.parent / "docs" / "hooks" / "generated.py").exists()


def test_check_threads_default_is_capped_by_the_cores_per_local_rank(monkeypatch, fresh_env) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    monkeypatch.setenv("RESHARD_EXT_CHECK_THREADS", "64")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert rx.Options().resolved_check_threads() == min(64, cores)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 2))  # more ranks than cores: the caller alone
    assert rx.Options().resolved_check_threads() == 1
    assert rx.Options(tuning=rx.Tuning(check_threads=6)).resolved_check_threads() == 6  # an explicit value is kept


def test_auto_direct_default_leaves_the_stages_of_relayed_plans_to_nccl(monkeypatch, fresh_env) -> None:
    assert rx.Options().resolved_auto_direct() and not rx.Options().resolved_auto_direct(relayed=True)
    for value in (True, False):  # asked for, either way: every plan alike
        assert {rx.Options(auto_direct=value).resolved_auto_direct(relayed=r) for r in (False, True)} == {value}
    monkeypatch.setenv("RESHARD_EXT_AUTO_DIRECT", "1")
    rx.options.reload_environment()
    assert rx.Options().resolved_auto_direct(relayed=True)


def test_license_ships_with_the_distribution() -> None:
    try:
        dist = importlib.metadata.distribution("reshard_ext")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("running from a source tree, not an installed distribution")
    licenses = [f for f in dist.files or [] if Path(str(f)).name == "LICENSE"]
    assert licenses, dist.files
    assert "Apache License" in Path(str(dist.locate_file(licenses[0]))).read_text()


def test_isolated_install_builds_nccl_where_nvcc_exists() -> None:
    # The README's `pip install .` (build isolation on) must build the NCCL transport
    # wherever it builds CUDA: the build backend brings nccl.h (tools/build_backend.py).
    if "site-packages" not in PKG.parts:
        pytest.skip("running from a source-tree build")
    if shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"):
        pytest.skip("no nvcc on this machine")
    if any(os.environ.get(k, "").upper() == "OFF" for k in ("RESHARD_EXT_CUDA", "RESHARD_EXT_NCCL")):
        pytest.skip("CUDA or NCCL turned off for this install")
    info = rx.build_info()
    if info["cuda_skipped"].startswith("no NVIDIA driver"):
        pytest.skip("installed on a machine without an NVIDIA driver, without RESHARD_EXT_CUDA=ON")
    assert info["cuda"] and info["nccl"], info
