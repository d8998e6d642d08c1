"""The warm swap's model fingerprint (reshard_ext/swap.py, _C.model_fingerprint): every change
that can alter a model's description changes it, and in-place weight updates do not.

A warm swap_model_weights reuses the memoized description (and so the plan and its bound
tensors) exactly when the fingerprint is unchanged: a change it misses would copy into stale
storage or with a stale layout.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from reshard_ext import swap
from reshard_ext.swap import _fingerprint


@pytest.fixture(params=["shim", "python"], autouse=True)
def reads(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with tensors read through torch's C shim and through Python (the
    fallback where the shim is unusable); the shim without its probe, which would fall back."""
    abi = swap._shim_abi() if request.param == "shim" else None
    monkeypatch.setattr(swap, "_tensor_abi", lambda: abi)
    return request.param


class _Config:
    num_moe_experts = None


class _Layer(nn.Module):
    def __init__(self, number: int):
        super().__init__()
        self.layer_number = number
        self.fc = nn.Module()
        self.fc.weight = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.fc.weight.tensor_model_parallel = True
        self.fc.weight.partition_dim = 0
        self.fc.weight.partition_stride = 1
        self.fc.bias = nn.Parameter(torch.randn(4), requires_grad=False)
        self.fc.weight.partition_sizes = [2, 2]
        self.router = nn.Module()
        self.router.register_buffer("expert_bias", torch.zeros(4))
        self.router.register_buffer("tokens", torch.zeros(4), persistent=False)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.pg_collection = object()
        self.config = _Config()
        self.share_embeddings_and_output_weights = False
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([_Layer(1), _Layer(2)])


class _Subclass(nn.Parameter):
    pass


class _Wrapper(nn.Module):  # DDP / Float16Module style
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module


def _w(m: _Model) -> nn.Parameter:
    return m.decoder.layers[1].fc.weight


def _set_data(m: _Model, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    w = _w(m)
    w.data = make(w.data)


CHANGES: dict[str, Callable[[_Model], None]] = {
    # parameters replaced
    "parameter replaced": lambda m: setattr(m.decoder.layers[1].fc, "weight", nn.Parameter(_w(m).detach().clone())),
    "parameter replaced in _parameters": lambda m: m.decoder.layers[1].fc._parameters.__setitem__(
        "weight", nn.Parameter(_w(m).detach().clone())),
    "storage replaced (.data =)": lambda m: _set_data(m, torch.zeros_like),
    "parameter set to None": lambda m: setattr(m.decoder.layers[0].fc, "bias", None),
    # resized, reshaped, restrided, retyped in place of the same object
    "resized in place": lambda m: _w(m).resize_(2, 4),
    "reshaped view": lambda m: _set_data(m, lambda t: t.view(2, 8)),
    "restrided view": lambda m: _set_data(m, lambda t: t.as_strided((4, 4), (1, 4))),
    "storage offset": lambda m: _set_data(m, lambda t: t.flatten()[1:13].view(3, 4)),
    "dtype view": lambda m: _set_data(m, lambda t: t.view(torch.int32)),
    "module cast": lambda m: m.to(torch.float64),
    "tensor swapped (swap_tensors)": lambda m: torch.utils.swap_tensors(
        _w(m), nn.Parameter(torch.zeros(4, 4), requires_grad=False)),
    "transposed in place": lambda m: _w(m).t_(),
    "class changed": lambda m: setattr(_w(m), "__class__", _Subclass),
    # re-sharded: Megatron's parallel attributes
    "tensor_model_parallel": lambda m: setattr(_w(m), "tensor_model_parallel", False),
    "partition_dim": lambda m: setattr(_w(m), "partition_dim", 1),
    "partition_stride": lambda m: setattr(_w(m), "partition_stride", 2),
    "partition_sizes replaced": lambda m: setattr(_w(m), "partition_sizes", [1, 3]),
    "partition_sizes mutated": lambda m: _w(m).partition_sizes.__setitem__(0, 3),
    "allreduce": lambda m: setattr(m.decoder.layers[0].fc.bias, "allreduce", False),
    # added / removed
    "parameter added": lambda m: setattr(m.decoder.layers[0].fc, "extra", nn.Parameter(torch.zeros(2))),
    "parameter removed": lambda m: delattr(m.decoder.layers[0].fc, "bias"),
    "parameter renamed": lambda m: m.decoder.layers[0].fc.register_parameter(
        "bias2", m.decoder.layers[0].fc._parameters.pop("bias")),
    "submodule renamed": lambda m: m.decoder.layers[0]._modules.__setitem__(
        "fc2", m.decoder.layers[0]._modules.pop("fc")),
    "buffer added": lambda m: m.decoder.layers[0].router.register_buffer("step", torch.zeros(1)),
    "buffer made non-persistent": lambda m: m.decoder.layers[0].router._non_persistent_buffers_set.add("expert_bias"),
    "buffer replaced": lambda m: setattr(m.decoder.layers[0].router, "expert_bias", torch.zeros(4)),
    "layer removed": lambda m: m.decoder.layers.__delitem__(1),
    "layer appended": lambda m: m.decoder.layers.append(_Layer(3)),
    "submodule replaced": lambda m: setattr(m.decoder.layers[0], "router", nn.Module()),
    "layer_number": lambda m: setattr(m.decoder.layers[1], "layer_number", 5),
    # the model's own identity and what the adapter reads from it
    "process groups": lambda m: setattr(m, "pg_collection", object()),
    "expert count": lambda m: setattr(m, "config", type("C", (), {"num_moe_experts": 4})()),
    "tying": lambda m: setattr(m, "share_embeddings_and_output_weights", True),
}


def _warm_check(m: _Model) -> Callable[[], bool]:
    """What a warm swap checks of a memoized model (swap._describe): its head, then its snapshot."""
    head, snap = swap._head([m]), swap._snapshot([m])
    assert snap.fingerprint == _fingerprint([m])[1]
    return lambda: swap._head([m]) == head and snap.unchanged()


@pytest.mark.parametrize("change", list(CHANGES))
def test_model_change_changes_the_fingerprint(change: str) -> None:
    m = _Model()
    before = _fingerprint([_Wrapper(m)])
    CHANGES[change](m)
    assert _fingerprint([_Wrapper(m)]) != before


@pytest.mark.parametrize("change", list(CHANGES))
def test_model_change_is_seen_by_the_snapshot(change: str) -> None:
    m = _Model()
    unchanged = _warm_check(m)
    assert unchanged()
    CHANGES[change](m)
    assert not unchanged()


def test_another_model_has_another_fingerprint() -> None:
    torch.manual_seed(0)
    a = _Model()
    b = _Model()
    b.pg_collection = a.pg_collection
    b.config = a.config
    assert _fingerprint([a]) != _fingerprint([b])
    assert _fingerprint([a, b]) != _fingerprint([b, a])  # chunk order: layer renames differ


def test_in_place_updates_keep_the_fingerprint() -> None:
    m = _Model()
    before = _fingerprint([_Wrapper(m)])
    unchanged = _warm_check(m)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1)  # an optimizer step: new values, same storages (the version counter moves)
        m.decoder.layers[0].router.expert_bias.copy_(torch.ones(4))
    assert _fingerprint([_Wrapper(m)]) == before
    assert unchanged(), "a warm swap after an optimizer step would walk the models again"


def test_what_the_description_does_not_read_keeps_the_snapshot() -> None:
    m = _Model()
    unchanged = _warm_check(m)
    m.eval()  # sets `training` on every module
    m.decoder.layers[0].cache = torch.zeros(2)  # an attribute the adapter never reads
    _w(m).main_grad = torch.zeros(4, 4)  # likewise, on a parameter
    m.register_forward_hook(lambda *a: None)
    assert unchanged()
    assert unchanged()  # and again, from the versions it adopted


def test_fingerprint_is_exact_for_big_ints() -> None:
    m = _Model()
    _w(m).partition_dim = 2**70  # packed exactly, not truncated to 64 bits
    big = _fingerprint([m])
    _w(m).partition_dim = 2**70 + 1
    assert _fingerprint([m]) != big


def test_a_subclass_parameter_is_read_through_python() -> None:
    m = _Model()
    m.decoder.layers[0].fc.weight = _Subclass(torch.randn(4, 4), requires_grad=False)
    before = _fingerprint([m])
    m.decoder.layers[0].fc.weight.resize_(2, 4)
    assert _fingerprint([m]) != before


def test_the_shim_reads_what_python_reads(reads: str) -> None:
    """On this torch the fingerprint reads plain tensors through the C shim (the fast path),
    and its probe refuses a shim that reads anything else."""
    if reads == "python":
        pytest.skip("the shim path only")
    abi = swap._shim_abi()
    assert swap._reads_like_python(abi), "torch's C shim unusable: warm swaps fall back to slow Python reads"
    t = torch.arange(24.0).view(4, 6)[1:, 2:5]
    ptr, dev, idx, _, n, *rest = abi.read(t)
    assert (ptr, dev, idx, n, rest) == (t.data_ptr(), 0, -1, 2, [3, 3, 6, 1])
    assert abi.read(_Subclass(torch.zeros(2))) is None  # a subclass: read through Python
    swapped = swap._shim_abi(("data_ptr", "dim", "strides", "sizes", "dtype", "device_type", "device_index"))
    assert not swap._reads_like_python(swapped)


def test_snapshots_are_used_on_this_python() -> None:
    assert swap._snapshots_work.__wrapped__(), "no dict versions: every warm swap walks both models again"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("change", ["to another GPU buffer", "to the host", "dtype view"])
def test_a_gpu_model_change_is_seen_by_the_snapshot(change: str) -> None:
    assert swap._reads_like_python(swap._shim_abi())  # its probe includes a CUDA tensor here
    m = _Model().cuda()
    unchanged = _warm_check(m)
    assert unchanged()
    w = _w(m)
    w.data = {"to another GPU buffer": lambda t: t.clone(), "to the host": lambda t: t.cpu(),
              "dtype view": lambda t: t.view(torch.int32)}[change](w.data)
    assert not unchanged()
