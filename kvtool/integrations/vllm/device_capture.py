"""Capture on CUDA: a layer's finished blocks copied to pinned host memory on a side stream.

The forward pass never waits for these copies: each waits on the device for
the layer's own work, and the step's end waits (on the host) only for copies
still in flight, so vLLM may reuse the blocks once the step is over.
"""

from __future__ import annotations

from typing import Sequence

import torch


class DeviceCapture:
    """Blocks of CUDA views copied to pinned host memory on a side stream, after the layer's own work."""

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device)
        self._pending: list[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor]] = []

    def gather(self, view: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
        """Queue the copy of blocks ``block_ids`` as ``[kv_heads, tokens, head_dim]``; the pinned tensor it fills."""
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(view.device))
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(written)
            index = torch.as_tensor(list(block_ids), dtype=torch.long).to(view.device, non_blocking=True)
            picked = view.index_select(0, index)
            n, heads, block, dim = picked.shape
            tokens = picked.permute(1, 0, 2, 3).reshape(heads, n * block, dim)
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        self._pending.append((done, tokens, host))
        return host

    def finish(self) -> None:
        """Wait for every queued copy; the step's blocks may then be reused."""
        for done, _, _ in self._pending:
            done.synchronize()
        self._pending.clear()

