"""A worker group's TCPStore listens on the worker's host only, never on every interface."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from kvferry.worker.group import host_store


def listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) of the sockets listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                out.append(addr)
    return out


def test_the_group_store_binds_the_worker_host_and_serves_its_ranks():
    store = host_store("127.0.0.1", 0, 2)
    assert listening(store.port) == ["0100007F"]  # 127.0.0.1, not 0.0.0.0 / ::
    peer = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, wait_for_workers=False)
    peer.set("rank1", b"here")
    assert store.get("rank1") == b"here"
