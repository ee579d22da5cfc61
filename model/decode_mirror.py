"""A contiguous copy of the decode batch's KV that persists across steps (CPU decode path).

Reading scattered KV blocks costs a gather per layer per step. While the decode batch keeps the same
requests in the same order, each step only appends one token per sequence, so the mirror appends the
new K/V and the attention reads contiguous memory. Any change of the batch (a request joins, finishes
or is preempted) rebuilds it from the paged cache, which stays the source of truth.

Layout per layer: K transposed, [Hkv * B, D, capacity] (so q @ K^T is a plain batched matmul), and V,
[Hkv * B, capacity, D]; row h * B + b is KV head h of sequence b.
"""

from __future__ import annotations

import torch


class DecodeMirror:
    def __init__(self, num_layers: int, max_bytes: int = 512 * 2**20, slack: int = 128):
        self.num_layers = num_layers
        self.max_bytes = max_bytes
        self.slack = slack
        self.members: list[object] = []
        self.lens: list[int] = []
        self._k_buf: torch.Tensor | None = None  # [L, rows_capacity, D, cap], reused as batches shrink
        self._v_buf: torch.Tensor | None = None  # [L, rows_capacity, cap, D]
        self.k_t: torch.Tensor | None = None  # [L, Hkv*B, D, cap] view of _k_buf
        self.v: torch.Tensor | None = None  # [L, Hkv*B, cap, D] view of _v_buf
        self.append = False
        self.width = 0
        self.positions: torch.Tensor | None = None  # [Hkv*B] slot of this step's token, head-major

    def prepare(self, members: list[object], lens: list[int], num_kv_heads: int, head_dim: int, like) -> bool:
        """Plan this step for the decode batch `members` with context `lens`; False = too big, don't use."""
        width = max(lens)
        rows = num_kv_heads * len(members)
        self.append = (
            self.k_t is not None
            and members == self.members
            and all(new == old + 1 for new, old in zip(lens, self.lens, strict=True))
            and width <= self.k_t.shape[-1]
        )
        if not self.append and not self._fit(rows, width, head_dim, like):
            self.members, self.k_t, self.v = [], None, None
            return False
        self.members, self.lens, self.width = list(members), list(lens), width
        pos = torch.tensor(lens, dtype=torch.long, device=like.device) - 1
        self.positions = pos.repeat(num_kv_heads)
        return True

    def _fit(self, rows: int, width: int, head_dim: int, like: torch.Tensor) -> bool:
        """Point k_t/v at buffers with >= rows and >= width; allocate (zeroed) only when they grow."""
        buf = self._k_buf
        if buf is None or buf.shape[1] < rows or buf.shape[-1] < width:
            cap = width + self.slack
            if 2 * self.num_layers * rows * cap * head_dim * like.element_size() > self.max_bytes:
                self._k_buf = self._v_buf = None
                return False
            # zeros, not empty: slots past a sequence's length are masked out, but NaN garbage
            # would survive the mask (NaN * 0 = NaN); later reuse leaves only finite KV behind
            kw = {"dtype": like.dtype, "device": like.device}
            self._k_buf = torch.zeros((self.num_layers, rows, head_dim, cap), **kw)
            self._v_buf = torch.zeros((self.num_layers, rows, cap, head_dim), **kw)
        self.k_t, self.v = self._k_buf[:, :rows], self._v_buf[:, :rows]
        return True

    def layer_kv(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, gather
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k_new, v_new: [B, Hkv, D], this step's. `gather()` -> (K, V) [Hkv*B, S, D] from the paged cache.

        Returns (K^T [Hkv*B, D, S], V [Hkv*B, S, D]) views of the mirror.
        """
        k_t, v = self.k_t[layer], self.v[layer]
        s = self.width
        if self.append:
            rows = torch.arange(k_t.shape[0], device=k_t.device)
            k_t[rows, :, self.positions] = k_new.transpose(0, 1).reshape(k_t.shape[0], -1)
            v[rows, self.positions] = v_new.transpose(0, 1).reshape(v.shape[0], -1)
        else:
            keys, values = gather()
            k_t[:, :, :s].copy_(keys[:, :s].transpose(1, 2))
            v[:, :s].copy_(values[:, :s])
        return k_t[:, :, :s], v[:, :s]
