"""The transform interface: what goes on the wire for a tensor and how it is written back.

A transform rewrites plan entries before planning, so the core planner and transports
never learn about it (DESIGN section 5):

- ``rewrite_src(name, tensor, layout)`` on the ranks holding a source piece may replace
  the entry by wire entries (e.g. ``name + "::mx.data"`` in float8 and
  ``name + "::mx.scale"`` in uint8) and return a ``before`` step that fills them from the
  source at the start of every ``execute`` (sender-side conversion);
- ``rewrite_dst(name, target, layout)`` on the ranks holding a destination piece replaces
  the entry by the entries the wire lands in (the same names the source side produced,
  or the plain name for a receiver-side conversion into a staging tensor) and returns an
  ``after`` step that writes the final buffers once every byte has arrived.

Both rewrites must derive the same wire names and global layouts from (name, layout)
alone, since sender and receiver apply them independently. ``after`` runs once all
batches of the refit are in, so a transform always sees whole tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .layout import Layout


@dataclass
class Rewrite:
    entries: dict[str, tuple[torch.Tensor, Layout]] = field(default_factory=dict)
    before: Optional[Callable[[], None]] = None
    after: Optional[Callable[[], None]] = None


class Transform:
    """Base class: transforms nothing. Subclasses override the two rewrites."""

    def rewrite_src(self, name: str, tensor: torch.Tensor, layout: Layout) -> Optional[Rewrite]:
        return None

    def rewrite_dst(self, name: str, target: Any, layout: Layout) -> Optional[Rewrite]:
        return None

    def cache_key(self) -> tuple:
        """What distinguishes two transforms for plan caching."""
        return (type(self).__name__,)
