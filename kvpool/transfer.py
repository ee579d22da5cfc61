"""Block data transport: torch.distributed point-to-point over pair groups made on demand.

A pair group is a two-rank process group between one client process (rank 1) and one pool node
(rank 0), rendezvousing in the cluster's Redis under a fresh name (kvpool.rendezvous). There is no
global world: a process holds one pair group per peer, made the first time it talks to that peer and
reused after.
Backend: gloo (`make_pair_group` can make an NCCL one, but the data plane's tagged CPU headers need
gloo: `dataplane.PairLink` asks for gloo whatever the devices). Only raw tensors travel here;
the control messages (which blocks, which slots) are protobuf on gRPC.

Canonical block layout (the pool object, independent of TP): [L, 2 (K/V), H_kv, block_size, D] in the
model dtype. A transfer carries n blocks of a KV-head slice: [n, L, 2, heads, block_size, D].
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvferry.kernels.int8 import kv_row_width
from kvferry.kernels.select import triton_pack_ops

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class BlockLayout:
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def block_bytes(self) -> int:
        n = self.torch_dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    def slice_shape(
        self, num_blocks: int, head_begin: int, head_end: int, layer_begin: int = 0, layer_end: int = 0
    ) -> tuple[int, ...]:
        """[n, layers, 2, heads, block_size, D] of a slice (layer_end 0: to the last layer)."""
        layers = (layer_end or self.num_layers) - layer_begin
        return (num_blocks, layers, 2, head_end - head_begin, self.block_size, self.head_dim)

    def check_heads(self, head_begin: int, head_end: int, layer_begin: int = 0, layer_end: int = 0) -> None:
        if not 0 <= head_begin < head_end <= self.num_kv_heads:
            raise ValueError(f"KV-head slice [{head_begin}, {head_end}) outside [0, {self.num_kv_heads})")
        if not 0 <= layer_begin < (layer_end or self.num_layers) <= self.num_layers:
            raise ValueError(f"layer slice [{layer_begin}, {layer_end}) outside [0, {self.num_layers})")

    def whole(self, head_begin: int, head_end: int, layer_begin: int = 0, layer_end: int = 0) -> bool:
        """Whether the slice is every KV head of every layer (a block's bytes are one range)."""
        return (head_begin, head_end, layer_begin, layer_end or self.num_layers) == (
            0,
            self.num_kv_heads,
            0,
            self.num_layers,
        )

    def to_list(self) -> list:
        return [self.num_layers, self.num_kv_heads, self.block_size, self.head_dim, self.dtype]

    @classmethod
    def from_list(cls, values: list) -> BlockLayout:
        layers, heads, bs, dim, dtype = values
        return cls(int(layers), int(heads), int(bs), int(dim), str(dtype))

    @classmethod
    def for_model(cls, model_cfg, block_size: int, kv_dtype: torch.dtype) -> BlockLayout:
        """The one derivation of a pool block's layout: the whole model's KV heads (a tensor-parallel
        rank writes its slice of them) in the KV cache's dtype (`model.config.kv_cache_dtype`); for an
        int8 cache `head_dim` is a row's width, D + 4 (its values and scale, `kernels.int8`)."""
        width = kv_row_width(model_cfg.kv_cache_dim, kv_dtype)
        return cls(
            model_cfg.num_cache_layers, model_cfg.num_kv_heads, block_size, width, dtype_name(kv_dtype)
        )


def check_interface(name: str) -> None:
    """Refuse at start a data_interface this host does not have (rather than at the first transfer)."""
    if name:
        try:
            socket.if_nametoindex(name)
        except OSError:
            have = ", ".join(n for _, n in socket.if_nameindex())
            raise ValueError(
                f"data_interface {name!r}: no such network interface here (have: {have})"
            ) from None


def make_pair_group(
    store: dist.Store, name: str, rank: int, backend: str, host: str, timeout_s: float, interface: str = ""
) -> dist.ProcessGroup:
    """Join the two-rank group `name` on `store` as `rank` (blocks until the peer joins too); gloo binds
    `interface` (PoolConfig.data_interface) when given, else `host`."""
    prefix = dist.PrefixStore(f"kvferry/pair/{name}/", store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(prefix, rank, 2, opts)
    if backend != "gloo":
        raise ValueError(f"unknown transfer backend {backend!r}")
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    where = {"interface": interface} if interface else {"hostname": host}
    opts._devices = [dist.ProcessGroupGloo.create_device(**where)]
    return dist.ProcessGroupGloo(prefix, rank, 2, opts)


CHUNK_BYTES = 2 * 2**20  # one transfer moves in messages of about this size, pipelined


def next_tag(tag: int, messages: int) -> int:
    """The tag after a transfer that used `tag` (its header) and `messages` data messages after it."""
    return (tag + messages + 2) % 2**30 or 1


def chunk_plan(num_blocks: int, chunk_blocks: int) -> list[tuple[int, int]]:
    """(first block, count) of each message of a transfer."""
    return [(i, min(chunk_blocks, num_blocks - i)) for i in range(0, num_blocks, chunk_blocks)]


def send_stream(group, peer: int, base_tag: int, plan, chunk) -> None:
    """Send the chunks of `plan`; `chunk(i, first, count)` returns the tensor for message i.

    Sends are asynchronous, so `chunk(i + 1)` (packing, gathering) overlaps message i on the wire. A
    caller that packs into staging may alternate two buffers by i % 2: message i - 2 has completed
    before `chunk(i)` is called.
    """
    works = []
    for i, (first, count) in enumerate(plan):
        if i >= 2:
            works[i - 2].wait()
        works.append(group.send([chunk(i, first, count)], peer, base_tag + i))
    for work in works[-2:]:
        work.wait()


def recv_stream(group, peer: int, base_tag: int, plan, dest, consume=None) -> None:
    """Receive the chunks of `plan` into `dest(i, first, count)`; then `consume(i, first, count, t)`.

    The receive of message i + 1 is posted before message i is consumed, so copying out overlaps the
    wire; `dest` may alternate two staging buffers by i % 2.
    """
    if not plan:
        return
    bufs = [dest(0, *plan[0])]
    works = [group.recv([bufs[0]], peer, base_tag)]
    for i, (first, count) in enumerate(plan):
        if i + 1 < len(plan):
            bufs.append(dest(i + 1, *plan[i + 1]))
            works.append(group.recv([bufs[i + 1]], peer, base_tag + i + 1))
        works[i].wait()
        if consume is not None:
            consume(i, first, count, bufs[i])


def send(group: dist.ProcessGroup, tensor: torch.Tensor, peer: int, tag: int) -> None:
    group.send([tensor], peer, tag).wait()


def recv(group: dist.ProcessGroup, tensor: torch.Tensor, peer: int, tag: int) -> None:
    group.recv([tensor], peer, tag).wait()


def runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive runs of `ids` as (position in ids, first id, length): [3,4,5,9] -> [(0,3,3), (3,9,1)]."""
    out: list[tuple[int, int, int]] = []
    for pos, i in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == i:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((pos, i, 1))
    return out


def pack_blocks(
    cache: torch.Tensor,
    block_ids: list[int],
    head_begin: int = 0,
    head_end: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged cache [L, 2, H, num_blocks, bs, D] -> contiguous [n, L, 2, heads, bs, D] (one copy per run;
    one Triton launch for a cache on CUDA packing on the GPU, `kernels.select.triton_pack_ops`; into a
    host buffer, the copies do the device-to-host move)."""
    triton_ops = triton_pack_ops(cache.device)
    if triton_ops is not None and (out is None or out.device == cache.device):
        return triton_ops[0](cache, block_ids, head_begin, head_end, out)
    head_end = cache.shape[2] if head_end is None else head_end
    heads = cache[:, :, head_begin:head_end]
    if out is None:
        out = torch.empty(
            (len(block_ids), cache.shape[0], 2, head_end - head_begin, *cache.shape[4:]),
            dtype=cache.dtype,
            device=cache.device,
        )
    for pos, first, length in runs(block_ids):
        out[pos : pos + length].copy_(heads[:, :, :, first : first + length].permute(3, 0, 1, 2, 4, 5))
    return out


def unpack_blocks(cache: torch.Tensor, block_ids: list[int], data: torch.Tensor, head_begin: int = 0) -> None:
    """Write [n, L, 2, heads, bs, D] into the paged cache's blocks `block_ids` (one copy per run; the
    Triton kernel when both are on the GPU; from a host buffer, the copies do the host-to-device move)."""
    triton_ops = triton_pack_ops(cache.device)
    if triton_ops is not None and data.device == cache.device:
        return triton_ops[1](cache, block_ids, data, head_begin)
    heads = cache[:, :, head_begin : head_begin + data.shape[3]]
    for pos, first, length in runs(block_ids):
        heads[:, :, :, first : first + length].copy_(data[pos : pos + length].permute(1, 2, 3, 0, 4, 5))


class Staging:
    """Two reusable transfer buffers (grown on demand, never shrunk): no page faults per transfer."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.bufs = [torch.empty(0, dtype=dtype, device=device) for _ in range(2)]

    def view(self, shape: tuple[int, ...], which: int = 0) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        which %= 2
        if self.bufs[which].numel() < numel:
            self.bufs[which] = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self.bufs[which][:numel].view(shape)
