"""A userspace delay line for a namespace's link: every packet waits `--delay-ms` before it goes on.

Why: emulated hosts (network namespaces joined by veth pairs) need WAN-like latency, and this kernel has
no netem qdisc (nor fq), so the delay cannot be a qdisc. It has nfnetlink_queue, so iptables sends an
interface's packets to a queue (`-j NFQUEUE --queue-bypass`: with no daemon bound they pass) and this
daemon holds each packet's verdict until it is due. Stdlib only: a NETLINK_NETFILTER socket.

Egress or ingress (`iptables_rules`): a packet held on egress (OUTPUT) is still charged to its sending
socket. TCP Small Queues lets a TCP socket keep only ~1 ms of its pacing rate inside the host, so a TCP
sender behind an egress delay of a few ms starves (measured on veth: 1 ms ~1 GB/s; 5 ms 1 MB/s with
BBR, 40 MB/s with cubic), and a UDP socket sends at most SO_SNDBUF per delay (20 ms: ~10k packets/s).
netem escapes that with skb_orphan_partial(); nfqueue cannot. On ingress (INPUT, in the receiving
namespace) ip_rcv has already orphaned the packet and TCP runs at its window's rate (20 ms: ~100 MB/s).
So for more than ~1 ms, delay the peer's ingress rather than this side's egress. And start the delay
before the connections: one opened on the undelayed link keeps its µs minimum RTT (BBR: for 10 s).

The protocol (include/uapi/linux/netfilter/nfnetlink_queue.h): every message is an nlmsghdr
(len, type, flags, seq, pid; host order) whose type is NFNL_SUBSYS_QUEUE << 8 | NFQNL_MSG_*, then an
nfgenmsg (family, version, res_id = the queue number, big-endian), then nlattrs (len, type; 4-byte
aligned; their payloads are big-endian). NFQNL_MSG_CONFIG binds the queue (NFQA_CFG_CMD), copies only
the metadata (NFQA_CFG_PARAMS, NFQNL_COPY_META), lets it hold 65536 packets (NFQA_CFG_QUEUE_MAXLEN)
and sets NFQA_CFG_FLAGS (with NFQA_CFG_MASK): FAIL_OPEN (a full queue or socket accepts instead of
dropping) and GSO (a 64 KB GSO packet comes as one, not segmented). The kernel then sends one
NFQNL_MSG_PACKET per packet; its NFQA_PACKET_HDR holds the packet id, and the ids rise in queue order.
The arrival time is this process's monotonic clock when the message is read (the kernel sends no
NFQA_TIMESTAMP on egress). As the delay is constant, due times are FIFO too: one
NFQNL_MSG_VERDICT_BATCH (NF_ACCEPT, the highest id due) releases every packet due at once. A lost
packet (`--loss P`, drawn from `--seed`) gets an NF_DROP NFQNL_MSG_VERDICT as it arrives; the loss is
per packet as queued, so per GSO packet (up to 64 KB) for bulk TCP.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import os
import random
import select
import shutil
import signal
import socket
import struct
import sys
import time
from collections.abc import Iterator

NETLINK_NETFILTER = 12
SO_RCVBUFFORCE = 33
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NFNL_SUBSYS_QUEUE = 3
NFNETLINK_V0 = 0
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR, NFQA_SKB_INFO = 1, 2, 14
NFQA_SKB_GSO = 0x02
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_CFG_CMD_UNBIND, NFQNL_CFG_CMD_PF_BIND, NFQNL_CFG_CMD_PF_UNBIND = 1, 2, 3, 4
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 0x01, 0x04
NF_DROP, NF_ACCEPT = 0, 1
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER

_NLMSGHDR = struct.Struct("=IHHII")
_NFGENMSG = struct.Struct("!BBH")
_NLATTR = struct.Struct("=HH")
_BE32 = struct.Struct("!I")
_VERDICT_HDR = struct.Struct("!II")  # nfqnl_msg_verdict_hdr: verdict, id
_RCVBUF = 64 << 20


def _attr(kind: int, payload: bytes) -> bytes:
    size = _NLATTR.size + len(payload)
    return _NLATTR.pack(size, kind) + payload + b"\0" * (-size % 4)


def _message(msg: int, queue: int, attrs: bytes, flags: int = 0, seq: int = 0, family: int = 0) -> bytes:
    body = _NFGENMSG.pack(family, NFNETLINK_V0, queue) + attrs
    size = _NLMSGHDR.size + len(body)
    return _NLMSGHDR.pack(size, NFNL_SUBSYS_QUEUE << 8 | msg, NLM_F_REQUEST | flags, seq, 0) + body


def _messages(buf: memoryview) -> Iterator[tuple[int, int, memoryview]]:
    """(type, seq, payload) of each nlmsg in one datagram."""
    off = 0
    while off + _NLMSGHDR.size <= len(buf):
        size, kind, _flags, seq, _pid = _NLMSGHDR.unpack_from(buf, off)
        if size < _NLMSGHDR.size or off + size > len(buf):
            return
        yield kind, seq, buf[off + _NLMSGHDR.size : off + size]
        off += (size + 3) & ~3


def _attrs(buf: memoryview) -> Iterator[tuple[int, memoryview]]:
    """(type, payload) of each nlattr in `buf`."""
    off = 0
    while off + _NLATTR.size <= len(buf):
        size, kind = _NLATTR.unpack_from(buf, off)
        if size < _NLATTR.size or off + size > len(buf):
            return
        yield kind & NLA_TYPE_MASK, buf[off + _NLATTR.size : off + size]
        off += (size + 3) & ~3


class DelayLine:
    """Queue `queue` of this network namespace, bound: each packet's NF_ACCEPT `delay_ms` after it
    arrived, or an NF_DROP with probability `loss`."""

    def __init__(self, queue: int, delay_ms: float, loss: float = 0.0, seed: int = 0):
        self.queue, self.delay_ns, self.loss = queue, int(delay_ms * 1e6), loss
        self.rng = random.Random(seed)
        self.pending: collections.deque[tuple[int, int]] = collections.deque()  # (due ns, packet id)
        self.stats = dict.fromkeys(("packets", "gso", "dropped", "enobufs", "errors"), 0)
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, _RCVBUF)
        self.sock.bind((0, 0))
        self._seq = 0
        self._buf = bytearray(1 << 17)

    def _request(self, attrs: bytes, queue: int | None = None, family: int = 0) -> None:
        """One NFQNL_MSG_CONFIG, acknowledged; packets that come meanwhile are queued as usual."""
        self._seq += 1
        q = self.queue if queue is None else queue
        self.sock.send(_message(NFQNL_MSG_CONFIG, q, attrs, NLM_F_ACK, self._seq, family))
        deadline, err = time.monotonic() + 5, None
        while err is None and select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
            for kind, seq, payload in self._receive(block=True):
                if kind == NLMSG_ERROR and seq == self._seq:
                    err = -struct.unpack_from("=i", payload)[0]
        if err is None:
            raise TimeoutError("nfqueue config: no acknowledgement")
        if err:
            raise OSError(err, f"nfqueue config: {os.strerror(err)}")

    def bind(self) -> None:
        cmd = struct.Struct("!BxH").pack  # nfqnl_msg_config_cmd: command, pad, pf
        self._request(_attr(NFQA_CFG_CMD, cmd(NFQNL_CFG_CMD_PF_UNBIND, socket.AF_INET)), 0, socket.AF_INET)
        self._request(_attr(NFQA_CFG_CMD, cmd(NFQNL_CFG_CMD_PF_BIND, socket.AF_INET)), 0, socket.AF_INET)
        self._request(_attr(NFQA_CFG_CMD, cmd(NFQNL_CFG_CMD_BIND, 0)))
        self._request(_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)))
        self._request(_attr(NFQA_CFG_QUEUE_MAXLEN, _BE32.pack(65536)))
        flags = _BE32.pack(NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO)
        self._request(_attr(NFQA_CFG_MASK, flags) + _attr(NFQA_CFG_FLAGS, flags))

    def _receive(self, block: bool) -> Iterator[tuple[int, int, memoryview]]:
        """The messages of one datagram; a packet's is handled here (and yielded too)."""
        try:
            n = self.sock.recv_into(self._buf, 0, 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as e:  # ENOBUFS: the socket overflowed; FAIL_OPEN accepted those packets
            if e.errno != errno.ENOBUFS:
                raise
            count = self.stats["enobufs"] = self.stats["enobufs"] + 1
            if count & (count - 1) == 0:  # 1, 2, 4, ...: a bounded log
                print(f"linkdelay: ENOBUFS, socket overflowed (count={count})", file=sys.stderr, flush=True)
            return
        now = time.monotonic_ns()
        for kind, seq, payload in _messages(memoryview(self._buf)[:n]):
            if kind == NFNL_SUBSYS_QUEUE << 8 | NFQNL_MSG_PACKET:
                self._arrived(payload[_NFGENMSG.size :], now)
            elif kind == NLMSG_ERROR and seq == 0 and struct.unpack_from("=i", payload)[0]:
                self.stats["errors"] += 1  # a verdict the kernel refused (unknown id)
            yield kind, seq, payload

    def _arrived(self, attrs: memoryview, now: int) -> None:
        packet_id = None
        for kind, value in _attrs(attrs):
            if kind == NFQA_PACKET_HDR:
                packet_id = _BE32.unpack_from(value)[0]
            elif kind == NFQA_SKB_INFO and _BE32.unpack_from(value)[0] & NFQA_SKB_GSO:
                self.stats["gso"] += 1  # passed whole: the GSO flag took
        if packet_id is None:
            return
        self.stats["packets"] += 1
        if self.loss and self.rng.random() < self.loss:
            self.stats["dropped"] += 1
            self._verdict(NFQNL_MSG_VERDICT, NF_DROP, packet_id)
        else:
            self.pending.append((now + self.delay_ns, packet_id))

    def _verdict(self, msg: int, verdict: int, packet_id: int) -> None:
        try:  # on a failure the packet waits for the next batch verdict, which covers it too
            self.sock.send(
                _message(msg, self.queue, _attr(NFQA_VERDICT_HDR, _VERDICT_HDR.pack(verdict, packet_id)))
            )
        except OSError:
            self.stats["errors"] += 1

    def release(self, now: int) -> None:
        """NF_ACCEPT every packet due by `now`: one batch verdict up to the last of them."""
        last = None
        while self.pending and self.pending[0][0] <= now:
            last = self.pending.popleft()[1]
        if last is not None:
            self._verdict(NFQNL_MSG_VERDICT_BATCH, NF_ACCEPT, last)

    def run(self, wakeup: socket.socket, stopping: list[bool]) -> None:
        """Until `stopping[0]`: read packets, release those due (`wakeup` readable: look again)."""
        while not stopping[0]:
            timeout = None
            if self.pending:
                timeout = max(0.0, (self.pending[0][0] - time.monotonic_ns()) / 1e9)
            ready, _, _ = select.select([self.sock, wakeup], [], [], timeout)
            if wakeup in ready:
                with contextlib.suppress(BlockingIOError):
                    wakeup.recv(4096)
            if self.sock in ready:
                for _ in range(256):  # then release what fell due, even under a flood
                    if not any(True for _ in self._receive(block=False)):
                        break
            self.release(time.monotonic_ns())

    def close(self) -> None:
        """Accept what is held or was read (an unbind drops what it finds queued), unbind, close.
        Packets that come in between are dropped: remove the iptables rules first for none."""
        while any(True for _ in self._receive(block=False)):
            pass
        if self.pending:
            self._verdict(NFQNL_MSG_VERDICT_BATCH, NF_ACCEPT, self.pending[-1][1])
            self.pending.clear()
        try:
            with contextlib.suppress(OSError):  # never bound (the bind failed): nothing to unbind
                self._request(_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_UNBIND, 0)))
        finally:
            self.sock.close()


def iptables_binary() -> str:
    """iptables-legacy where installed (this kernel's tables), else iptables."""
    return shutil.which("iptables-legacy") or shutil.which("iptables") or "iptables"


def iptables_rules(iface: str, queue: int, delete: bool = False, ingress: bool = False) -> list[list[str]]:
    """The iptables commands (argv; run them in the namespace) that send `iface`'s egress (`ingress`:
    the packets it delivers to this host) to `queue`, passing them while no daemon is bound; with
    `delete`, those that remove them."""
    where = ["INPUT", "-i", iface] if ingress else ["OUTPUT", "-o", iface]
    rule = [*where, "-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass"]
    return [[iptables_binary(), "-w", "-D" if delete else "-I", *rule]]


def daemon_argv(queue: int, delay_ms: float, loss: float = 0.0, seed: int = 0) -> list[str]:
    """The command line of the delay line (run it in the namespace, e.g. under `ip netns exec`)."""
    argv = [sys.executable, "-m", "kvferry.deploy.linkdelay", "--queue", str(queue)]
    return [*argv, "--delay-ms", str(delay_ms), "--loss", str(loss), "--seed", str(seed)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, required=True, help="the NFQUEUE number to bind")
    parser.add_argument("--delay-ms", type=float, required=True, help="the delay of every packet")
    parser.add_argument("--loss", type=float, default=0.0, help="the probability a packet is dropped")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the loss draws")
    args = parser.parse_args(argv)
    if not 0.0 <= args.loss <= 1.0:
        parser.error("--loss is a probability, 0 to 1")
    stopping = [False]
    wakeup, wakeup_w = socket.socketpair()
    wakeup.setblocking(False)
    wakeup_w.setblocking(False)
    signal.set_wakeup_fd(wakeup_w.fileno(), warn_on_full_buffer=False)

    def stop(_signum: int, _frame: object) -> None:
        stopping[0] = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    line = DelayLine(args.queue, args.delay_ms, args.loss, args.seed)
    try:
        line.bind()
        print(f"linkdelay ready queue={args.queue}", flush=True)
        line.run(wakeup, stopping)
    except OSError as e:  # EPERM: another process has bound the queue
        print(f"linkdelay: queue {args.queue}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        line.close()
        stats = " ".join(f"{k}={v}" for k, v in line.stats.items())
        print(f"linkdelay stopped queue={args.queue} {stats}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
