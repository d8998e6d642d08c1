"""A verified execute's digests (kernels/digest.h: a uint64 per op at each end) as the
check sees them: host arrays, or a device buffer whose lane sums are taken where it is."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def lanes(d: np.ndarray) -> np.ndarray:
    """The digest::add sum of uint64 digests as its two 32-bit lanes (int64, mod 2^32)."""
    return np.array([int((d & 0xFFFFFFFF).sum()) & 0xFFFFFFFF, int((d >> 32).sum()) & 0xFFFFFFFF], dtype=np.int64)


class DeviceDigests:
    """(send, recv) digests left where the kernels wrote them: `buf` (int64, one per slot),
    `signs` (+1 for a send slot, -1 for a receive slot, 0 for neither; same device) and
    `host()`, which brings them out as (send, recv) uint64 arrays indexed by op. A refit
    whose digests match moves no digest to the host. `settle()` waits (host) for the refit
    that wrote them and raises where it failed: the check queues its own work first, so
    that it runs while the refit still does."""

    def __init__(self, buf: torch.Tensor, signs: torch.Tensor, host: Callable[[], tuple[np.ndarray, np.ndarray]],
                 settle: Callable[[], None] = lambda: None):
        self.buf, self.signs, self.host, self.settle = buf, signs, host, settle

    def lane_difference(self) -> torch.Tensor:
        """lanes(send) - lanes(recv) before the mod 2^32, as two int64 on buf's device,
        queued on its current stream (no wait)."""
        # Each uint64 as its (low, high) words read as int32 (little-endian): a word and its
        # unsigned value differ by a multiple of 2^32, which the mod 2^32 of the check drops.
        # Two launches, queued on a GPU about to go idle.
        return (self.buf.view(torch.int32).view(-1, 2) * self.signs[:, None]).sum(dim=0)


Digests = tuple[np.ndarray, np.ndarray] | DeviceDigests


def fold_into(into: torch.Tensor, per_box: torch.Tensor, rows: torch.Tensor, ops: torch.Tensor) -> None:
    """Adds digests of pieces into their ops' digests, lane by lane (digest::add), in place
    on their device (queued, no wait): per_box[i] (int64 views of uint64) into
    into[ops[rows[i]]]; a row of len(ops) drops its piece. A direct sender's staged boxes
    are digested piece by piece (the ring as each chunk leaves it) and folded so."""
    words = torch.zeros((ops.numel() + 1, 2), dtype=torch.int64, device=into.device)
    words.index_add_(0, rows, per_box.view(torch.int32).view(-1, 2).to(torch.int64))
    words = words[:-1] + into[ops].view(torch.int32).view(-1, 2).to(torch.int64)
    lo, hi = words[:, 0] & 0xFFFFFFFF, words[:, 1] & 0xFFFFFFFF
    into[ops] = (hi - (hi >> 31) * (1 << 32)) * (1 << 32) + lo  # the high word as int32, so no int64 overflow
