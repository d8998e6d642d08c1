"""Exceptions. ReshardError is the compiled module's, so C++ checks raise it directly."""
from ._C import InternalError, ReshardError

__all__ = ["ReshardError", "InternalError"]
