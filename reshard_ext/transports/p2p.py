"""torch.distributed point-to-point exchange of one batch's staging regions."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class P2PExchange:
    def __init__(self, group: Any):
        self.group = group
        self._global: dict[int, int] = {}

    def global_rank(self, group_rank: int) -> int:
        g = self._global.get(group_rank)
        if g is None:
            g = self._global[group_rank] = dist.get_global_rank(self.group, group_rank)
        return g

    def exchange(self, regions: tuple[list, list], send_buf: torch.Tensor, recv_buf: torch.Tensor) -> None:
        """One send and one receive per peer: regions = ([(peer, offset, bytes)], [...])."""
        sends, recvs = regions
        ops = [
            dist.P2POp(dist.isend, send_buf[off : off + n], self.global_rank(peer), self.group)
            for peer, off, n in sends
        ] + [
            dist.P2POp(dist.irecv, recv_buf[off : off + n], self.global_rank(peer), self.group)
            for peer, off, n in recvs
        ]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
