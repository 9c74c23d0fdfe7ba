"""What the last stage's rank tells the others after each step, in one collective where it is small.

``torch.distributed.broadcast_object_list`` sends an object's size, then its bytes: two collectives
a step, each a round of latency between processes (about a millisecond between CPU processes). A
step's loss, logs and metric states usually take a few kilobytes, so they go in one broadcast of a
fixed buffer that holds their size and bytes; a larger message goes on in a second broadcast.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

CAPACITY = 1 << 16
"""Bytes a message may take to go in one collective."""


def broadcast_object(obj: Any, src: int, group: Any, device: torch.device) -> Any:
    """``obj`` as rank ``src`` of ``group`` (``None``: every rank) holds it, on every rank of ``group``."""
    sending = dist.get_rank(group) == src
    buffer = torch.zeros(8 + CAPACITY, dtype=torch.uint8, device=device)
    data = pickle.dumps(obj) if sending else b""
    if sending:
        buffer[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        if len(data) <= CAPACITY:
            buffer[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buffer, group_src=src, group=group)
    header = buffer[:8].cpu()
    size = int.from_bytes(bytes(header.tolist()), "little")
    if size <= CAPACITY:
        return pickle.loads(bytes(buffer[8 : 8 + size].cpu().numpy())) if not sending else obj
    box = [obj]
    dist.broadcast_object_list(box, group_src=src, group=group)
    return box[0]
