"""The public surface: `rx` and every module its `__all__` reaches (rx.adapters, rx.merged,
...) declare `__all__`, and it holds only what reshard_ext defines: no `re`, `torch` or
typing names that a module merely imports. The packages show the same names to `dir()`."""
from __future__ import annotations

import types

import reshard_ext as rx


def _public_modules() -> list[types.ModuleType]:
    """rx, then every module named in a public module's __all__, recursively."""
    seen: dict[str, types.ModuleType] = {}
    todo = [rx]
    while todo:
        module = todo.pop()
        if module.__name__ in seen:
            continue
        seen[module.__name__] = module
        values = (getattr(module, n) for n in getattr(module, "__all__", ()))
        todo += [v for v in values if isinstance(v, types.ModuleType)]
    return list(seen.values())


def _defined_here(value: object) -> bool:
    """Defined by reshard_ext: its modules, classes, functions; constants and type aliases."""
    if isinstance(value, types.ModuleType):
        return value.__name__.startswith("reshard_ext")
    if isinstance(value, (int, float, str, bytes, tuple, frozenset, dict, types.GenericAlias, types.UnionType)):
        return True
    return str(getattr(value, "__module__", "")).startswith("reshard_ext")


def test_public_modules_are_found() -> None:
    names = {m.__name__ for m in _public_modules()}
    assert {"reshard_ext", "reshard_ext.adapters", "reshard_ext.adapters.megatron", "reshard_ext.adapters.dtensor",
            "reshard_ext.merged", "reshard_ext.relay"} <= names, names


def test_every_public_module_declares_only_its_own_names() -> None:
    for module in _public_modules():
        exported = getattr(module, "__all__", None)
        assert exported is not None, f"{module.__name__} has no __all__"
        assert len(set(exported)) == len(exported), f"{module.__name__}.__all__ repeats a name"
        for name in exported:
            assert hasattr(module, name), f"{module.__name__}.__all__ names {name}, which it lacks"
            value = getattr(module, name)
            assert _defined_here(value), f"{module.__name__}.__all__ re-exports {name} ({value!r})"


def test_packages_show_only_their_public_names() -> None:
    import reshard_ext.adapters as adapters

    for package in (rx, adapters):
        shown = {n for n in dir(package) if not n.startswith("_")}
        assert shown == set(package.__all__) - {"__version__"}, (package.__name__, shown ^ set(package.__all__))
        for imported in ("re", "torch", "Callable", "Any", "os", "annotations"):
            assert imported not in shown
