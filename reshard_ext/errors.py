"""Exceptions. ReshardError is the compiled module's, so C++ checks raise it directly; it
is shown as reshard_ext.ReshardError, where users import it from."""
from ._C import InternalError, ReshardError

for _exc in (ReshardError, InternalError):
    _exc.__module__ = "reshard_ext"

__all__ = ["ReshardError", "InternalError"]
