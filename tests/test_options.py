"""rx.Options (the knobs a user sets), rx.Tuning (the expert ones) and their environment
variables: the former Options fields point to rx.Tuning, one RESHARD_EXT_TIMEOUT bounds every
transport, and the deprecated per-transport timeouts still work for one release, with a warning."""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import logging
import pickle
import re
from pathlib import Path

import pytest

import reshard_ext as rx
from reshard_ext import options

USER_FIELDS = ["timeout", "relay", "auto_direct", "direct_ipc", "check_storage", "trace", "tuning"]
TUNING_FIELDS = ["batch_bytes", "direct_bytes", "nccl_register", "max_blocks", "split_copies", "batch_taper",
                 "relay_stages", "direct_engine_bytes", "direct_engine_batch", "direct_engine_streams",
                 "direct_verify_groups", "direct_staging_bytes", "direct_prep_overlap", "direct_local_engine_bytes",
                 "direct_local_blocks", "check_threads", "host_ring"]
TRANSPORTS = ["gloo", "torch", "cpu", "nccl", "direct", "nvshmem"]
# each deprecated variable and the transports whose timeout it still sets
DEPRECATED = {"RESHARD_EXT_P2P_TIMEOUT": {"gloo", "torch", "cpu"}, "RESHARD_EXT_NCCL_TIMEOUT": {"nccl"},
              "RESHARD_EXT_DIRECT_TIMEOUT": {"direct"}, "RESHARD_EXT_NVSHMEM_TIMEOUT": {"nvshmem"}}


@pytest.fixture
def fresh_env(monkeypatch):
    for name in options.KNOBS:
        monkeypatch.delenv(name, raising=False)
    options.reload_environment()
    yield
    options.reload_environment()


def test_options_keep_the_user_fields_and_tuning_the_rest() -> None:
    assert [f.name for f in dataclasses.fields(rx.Options)] == USER_FIELDS
    assert len(USER_FIELDS) <= 8
    assert [f.name for f in dataclasses.fields(rx.Tuning)] == TUNING_FIELDS
    assert "Tuning" in rx.__all__ and rx.Tuning is options.Tuning
    assert list(inspect.signature(rx.Options).parameters) == USER_FIELDS  # what help() and IDEs show


@pytest.mark.parametrize("name", TUNING_FIELDS)
def test_a_former_options_field_points_to_tuning(name: str) -> None:
    pointer = rf"{name} moved to rx\.Tuning: rx\.Options\(tuning=rx\.Tuning\({name}=\.\.\.\)\)"
    with pytest.raises(rx.ReshardError, match=pointer):
        rx.Options(**{name: 1})
    with pytest.raises(rx.ReshardError, match=pointer):
        rx.Options(timeout=5.0).replace(**{name: 1})


def test_a_former_field_beside_user_fields_is_named_with_the_others() -> None:
    pointer = "rx.Options(tuning=rx.Tuning(batch_bytes=..., host_ring=...))"
    with pytest.raises(rx.ReshardError, match=re.escape(pointer)):
        rx.Options(timeout=3.0, batch_bytes=1 << 20, host_ring=False)


@pytest.mark.parametrize("owner,kwargs", [
    (rx.Options, {"timeout": 0}), (rx.Options, {"timeout": "10"}), (rx.Options, {"timeout": float("inf")}),
    (rx.Options, {"trace": 1}), (rx.Options, {"relay": "yes"}), (rx.Options, {"tuning": {"batch_bytes": 1}}),
    (rx.Tuning, {"batch_bytes": 0}), (rx.Tuning, {"batch_bytes": True}), (rx.Tuning, {"direct_bytes": -1}),
    (rx.Tuning, {"max_blocks": 1.5}), (rx.Tuning, {"relay_stages": -1}), (rx.Tuning, {"direct_engine_streams": 0}),
    (rx.Tuning, {"direct_verify_groups": 256}), (rx.Tuning, {"check_threads": 0}), (rx.Tuning, {"check_threads": 65}),
    (rx.Tuning, {"host_ring": 0}), (rx.Tuning, {"direct_local_blocks": -2}),
])
def test_bad_values_name_the_field(owner: type, kwargs: dict) -> None:
    (name, value), = kwargs.items()
    with pytest.raises(rx.ReshardError, match=re.escape(f"rx.{owner.__name__}({name}={value!r}): expected")):
        owner(**kwargs)


@pytest.mark.parametrize("name", TUNING_FIELDS)
def test_a_tuning_value_is_what_the_plan_resolves(name: str, fresh_env) -> None:
    is_flag = rx.Tuning.__dataclass_fields__[name].type == "bool | None"
    for value in ((False, True) if is_flag else (3, 7)):
        o = rx.Options(tuning=rx.Tuning(**{name: value}))
        resolve = getattr(o, f"resolved_{name}")
        got = resolve("cuda") if name == "direct_bytes" else resolve()
        assert got == value and type(got) is type(value), (name, value, got)
        assert getattr(o.with_tuning(**{name: value}).tuning, name) == value


def test_fields_are_keywords_only() -> None:
    # a positional value was batch_bytes before the split: it must not silently become a timeout
    with pytest.raises(TypeError):
        rx.Options(1 << 20)  # type: ignore[misc]
    with pytest.raises(TypeError):
        rx.Tuning(1 << 20)  # type: ignore[misc]


def test_options_with_tuning_survive_pickling_and_compare_by_value() -> None:
    o = rx.Options(timeout=3.0, relay=False, tuning=rx.Tuning(batch_bytes=1 << 20, host_ring=False))
    assert pickle.loads(pickle.dumps(o)) == o
    assert o.with_tuning(host_ring=True).tuning == rx.Tuning(batch_bytes=1 << 20, host_ring=True)
    assert rx.Options().with_tuning(relay_stages=2) == rx.Options(tuning=rx.Tuning(relay_stages=2))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_timeout_variable_bounds_every_transport(monkeypatch, fresh_env, transport: str) -> None:
    assert rx.Options().resolved_timeout(transport) == 600.0
    monkeypatch.setenv("RESHARD_EXT_TIMEOUT", "42")
    options.reload_environment()
    assert rx.Options().resolved_timeout(transport) == 42.0
    assert options.default_timeout(transport) == 42.0
    assert rx.Options(timeout=7).resolved_timeout(transport) == 7.0  # the field wins


@pytest.mark.parametrize("old", DEPRECATED)
def test_a_deprecated_timeout_variable_still_sets_its_transports_and_warns_once(
        monkeypatch, fresh_env, caplog, old: str) -> None:
    monkeypatch.setenv("RESHARD_EXT_TIMEOUT", "42")
    monkeypatch.setenv(old, "7")
    options.reload_environment()
    with caplog.at_level(logging.INFO, logger="reshard_ext"):
        for _ in range(3):
            for t in TRANSPORTS:
                want = 7.0 if t in DEPRECATED[old] else 42.0
                assert rx.Options().resolved_timeout(t) == want and options.default_timeout(t) == want, t
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and old in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert "RESHARD_EXT_TIMEOUT" in warned[0].getMessage() and "deprecated" in warned[0].getMessage()


@pytest.mark.parametrize("old", DEPRECATED)
def test_a_bad_deprecated_variable_is_still_an_error(monkeypatch, fresh_env, old: str) -> None:
    monkeypatch.setenv(old, "soon")
    options.reload_environment()
    with pytest.raises(rx.ReshardError, match=old):
        rx.Options().resolved_timeout(min(DEPRECATED[old]))
    assert any(old in p for p in options.environment_problems())


def test_deprecated_variables_name_a_live_replacement() -> None:
    deprecated = {k.env: k.deprecated_by for k in options.KNOBS.values() if k.deprecated_by}
    assert deprecated == {name: "RESHARD_EXT_TIMEOUT" for name in DEPRECATED}
    assert all(not options.KNOBS[new].deprecated_by for new in deprecated.values())


def _generated_docs():
    hook = Path(__file__).resolve().parents[1] / "docs" / "hooks" / "generated.py"
    if not hook.exists():
        pytest.skip("installed package: no docs beside it")
    spec = importlib.util.spec_from_file_location("_rx_docs_hook", hook)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_knob_reference_has_two_tables_and_lists_the_deprecated_variables() -> None:
    docs = _generated_docs()
    user, tuning, deprecated = (docs.knobs_table(kind) for kind in ("Options", "Tuning", "deprecated"))
    for field in USER_FIELDS[:-1]:
        assert f"| `{field}` |" in user, field
    for field in TUNING_FIELDS:
        assert f"| `{field}` |" in tuning and f"| `{field}` |" not in user, field
    assert "| `timeout` | `RESHARD_EXT_TIMEOUT` | 600 |" in user
    listed = [row.split("|")[column].strip(" `") for table, column in ((user, 2), (tuning, 2), (deprecated, 1))
              for row in table.splitlines()[2:]]
    assert sorted(listed) == sorted(options.KNOBS)  # every variable, in one row of one table
    for name in DEPRECATED:
        assert f"| `{name}` | `RESHARD_EXT_TIMEOUT` |" in deprecated, name
