"""What encrypting the KV data plane would cost: bytes/s of KV-sized messages over the data plane as it
is (gloo, plaintext) against the same bytes over TLS, and over a plain TCP socket from the same Python
code (which separates what TLS costs from what a Python socket loop costs).

The data plane is not encrypted: it is confined to the interface the operator names
(`pool.data_interface`, e.g. a private NIC), while the control plane (gRPC, internal mutual TLS) and
Redis (TLS with internal TLS on) are. This bench is the measurement behind that trade-off.

Two processes, each pinned to a core of its own: a receiver and a sender, `--mib` MiB in `--chunk-mib`
messages, best of `--repeats`. TLS is TLS 1.3 as Python's `ssl` (OpenSSL) negotiates it (AES-GCM with
AES-NI where the CPU has it), with a leaf of a cluster CA made here. `--hosts`: the two processes run on
two emulated hosts (`kvferry.deploy.testhosts`, a veth pair through a bridge, unshaped) instead of on
loopback. One JSON line: Gbit/s of each transport, of AES-256-GCM alone on one core, and the ratios
`tls_vs_gloo` (what an encrypted data plane would keep of today's) and `tls_vs_tcp` (the cipher's share
of it, the same socket loop with and without TLS).

    python bench/kv_encryption.py [--hosts] [--mib 2048] [--chunk-mib 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_result

SCRIPT = str(Path(__file__).resolve())
TRANSPORTS = ("gloo", "tcp", "tls")


def cpu_flags() -> str:
    """The flags that decide these figures (AES-NI for TLS, the vector widths), as the kernels read them."""
    from kvferry.kernels.cpu import cpu_flags as flags

    have = flags()
    return " ".join(f for f in ("aes", "vaes", "avx2", "avx512f", "amx_tile") if f in have)


# -- the two roles -----------------------------------------------------------------------------------------
def gloo_group(args, rank: int):
    import torch.distributed as dist

    from kvferry.kvpool.transfer import make_pair_group

    store = dist.FileStore(args.store, 2)  # a file both processes see: this bench opens no listener
    return make_pair_group(store, "bench", rank, "gloo", args.addr, 120)


def tls_context(args, server: bool) -> ssl.SSLContext:
    tls = Path(args.tls_dir)
    if server:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls / "cert.pem", tls / "key.pem")
    else:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(tls / "ca.pem")
        ctx.check_hostname = False  # the leaf names the cluster; the chain is checked
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def receive(args) -> None:
    """Receive `args.count` messages; print {seconds, bytes, cipher} (from the first byte to the last)."""
    import torch

    buf = torch.empty(args.nbytes, dtype=torch.uint8)
    if args.transport == "gloo":
        group = gloo_group(args, 0)
        group.recv([buf], 1, 0).wait(timedelta(seconds=120))  # a first message: the clock starts after it
        t0 = time.perf_counter()
        for i in range(1, args.count):
            group.recv([buf], 1, i).wait(timedelta(seconds=120))
        print(json.dumps({"seconds": time.perf_counter() - t0, "bytes": (args.count - 1) * args.nbytes}))
        return
    listener = socket.create_server((args.addr, 0))
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    cipher = ""
    if args.transport == "tls":
        conn = tls_context(args, server=True).wrap_socket(conn, server_side=True)
        cipher = conn.cipher()[0]
    view = memoryview(buf.numpy())
    t0, got = 0.0, 0
    total = args.count * args.nbytes
    while got < total:
        n = conn.recv_into(view[: min(len(view), total - got)])
        if n == 0:
            raise ConnectionError(f"the sender went away after {got} of {total} bytes")
        if got < args.nbytes <= got + n:
            t0 = time.perf_counter()  # the first message is in: the clock starts
        got += n
    seconds = time.perf_counter() - t0
    conn.sendall(b"k")  # the sender closes after this: closing earlier could reset the connection
    conn.close()
    print(json.dumps({"seconds": seconds, "bytes": total - args.nbytes, "cipher": cipher}))


def send(args) -> None:
    import torch

    buf = torch.randint(0, 255, (args.nbytes,), dtype=torch.uint8)
    if args.transport == "gloo":
        group = gloo_group(args, 1)
        for i in range(args.count):
            group.send([buf], 0, i).wait(timedelta(seconds=120))
        return
    conn = socket.create_connection((args.addr, args.port), timeout=60)
    if args.transport == "tls":
        conn = tls_context(args, server=False).wrap_socket(conn, server_hostname="kvferry-cluster")
    view = memoryview(buf.numpy())
    for _ in range(args.count):
        conn.sendall(view)
    conn.recv(1)  # the receiver has it all
    conn.close()


# -- the driver ----------------------------------------------------------------------------------------------
def one_run(args, transport: str, where, tmp: Path, rep: int) -> dict:
    recv_host, send_host = where
    common = ["--nbytes", str(args.nbytes), "--count", str(args.count), "--tls-dir", str(tmp)]
    common += ["--transport", transport, "--store", str(tmp / f"store-{transport}-{rep}")]
    recv_argv = [sys.executable, SCRIPT, "--role", "recv", "--addr", recv_host[1], *common]
    receiver = recv_host[0](recv_argv, stdout=subprocess.PIPE, text=True)
    try:
        port = "0" if transport == "gloo" else receiver.stdout.readline().strip()
        send_argv = [
            sys.executable,
            SCRIPT,
            "--role",
            "send",
            "--addr",
            recv_host[1],
            "--port",
            port,
            *common,
        ]
        if transport == "gloo":
            send_argv[send_argv.index("--addr") + 1] = send_host[1]  # gloo binds its own host's address
        sender = send_host[0](send_argv)
        out, _ = receiver.communicate(timeout=600)
        if sender.wait(60) != 0 or receiver.returncode != 0:
            raise RuntimeError(f"{transport}: a role failed")
    finally:
        for proc in (receiver,):
            if proc.poll() is None:
                proc.kill()
    return json.loads(out.strip().splitlines()[-1])


def drive(args) -> None:
    from kvferry.deploy.cluster_ca import ClusterCA

    args.nbytes = int(args.chunk_mib * 2**20)
    args.count = max(2, int(args.mib / args.chunk_mib) + 1)
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="kvenc-") as tmpdir:  # /var/tmp: hosts share it
        tmp = Path(tmpdir)
        addrs = ["198.18.9.1", "198.18.9.2"] if args.hosts else ["127.0.0.1", "127.0.0.1"]
        leaf = ClusterCA.create().issue(addrs)
        for name, pem in (("ca.pem", leaf.ca), ("cert.pem", leaf.cert), ("key.pem", leaf.key)):
            (tmp / name).write_bytes(pem)
        if args.hosts:
            from kvferry.deploy.testhosts import TestHosts

            with TestHosts(2, ["1", "0"], prefix="kvenc", subnet=9) as hosts:
                where = [(hosts[1].popen, hosts[1].address), (hosts[2].popen, hosts[2].address)]
                result = measure(args, where, tmp)
        else:
            cores = sorted(os.sched_getaffinity(0))

            def pinned(core):
                return lambda argv, **kw: subprocess.Popen(["taskset", "-c", str(core), *argv], **kw)

            where = [(pinned(cores[-1]), "127.0.0.1"), (pinned(cores[0]), "127.0.0.1")]
            result = measure(args, where, tmp)
    print_result(result)


def aes_gcm_gbit_s(nbytes: int, seconds: float = 2.0) -> float:
    """One core sealing `nbytes` messages with AES-256-GCM (OpenSSL, through `cryptography`): the
    cipher's own ceiling, what a TLS data plane could reach per core at best."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead, data = AESGCM(AESGCM.generate_key(bit_length=256)), os.urandom(nbytes)
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        aead.encrypt(os.urandom(12), data, None)
        done += nbytes
    return done * 8 / (time.perf_counter() - t0) / 1e9


def measure(args, where, tmp: Path) -> dict:
    best: dict[str, float] = {}
    cipher = ""
    for rep in range(args.repeats):
        for transport in TRANSPORTS:
            got = one_run(args, transport, where, tmp, rep)
            gbit = got["bytes"] * 8 / got["seconds"] / 1e9
            best[transport] = max(best.get(transport, 0.0), gbit)
            cipher = got.get("cipher") or cipher
    return {
        "bench": "kv_encryption",
        "link": "two emulated hosts (veth, unshaped)" if args.hosts else "loopback",
        "cpu_flags": cpu_flags(),
        "message_mib": args.chunk_mib,
        "mib_per_run": args.mib,
        "repeats": args.repeats,
        **{f"{t}_gbit_s": round(best[t], 2) for t in TRANSPORTS},
        "tls_cipher": cipher,
        "aes_256_gcm_one_core_gbit_s": round(aes_gcm_gbit_s(args.nbytes), 2),
        "tls_vs_gloo": round(best["tls"] / best["gloo"], 3),
        "tls_vs_tcp": round(best["tls"] / best["tcp"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", action="store_true", help="across two emulated hosts, not loopback")
    ap.add_argument("--mib", type=float, default=2048.0, help="MiB each run moves")
    ap.add_argument("--chunk-mib", type=float, default=2.0, help="one message (the data plane's CHUNK_BYTES)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--role", choices=("drive", "recv", "send"), default="drive", help=argparse.SUPPRESS)
    for name in ("--transport", "--addr", "--port", "--store", "--tls-dir"):
        ap.add_argument(name, default="", help=argparse.SUPPRESS)
    for name in ("--nbytes", "--count"):
        ap.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "recv":
        receive(args)
    elif args.role == "send":
        send(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
