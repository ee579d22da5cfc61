"""`kvferry up` as a user runs it: ready line, a request, `kvferry scale`, SIGTERM, nothing left behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cluster_helpers import wait_for

from kvferry import rpc
from kvferry.auth import SECRET_ENV
from kvferry.deploy.fault_harness import process_alive
from kvferry.kvpool.metadata import MetadataStore
from kvferry.router.client import Client, build_request
from kvferry.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow


def descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - out
        out |= frontier
    return out


def scale(redis_url_file: Path, *counts: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "kvferry.cli", "scale", "--redis-url-file", str(redis_url_file), *counts],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.timeout(600)  # 180 s for the ready line, up to 300 s per `kvferry scale`
def test_up_serves_scales_then_stops_cleanly_on_sigterm(tiny_model_dir, tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvferry.cli",
            "up",
            "--model",
            str(tiny_model_dir),
            "--port",
            "0",
            "--http-port",
            "0",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()

        def ready() -> bool:
            assert proc.poll() is None, proc.stderr.read()
            return any("ready" in line for line in lines)

        wait_for(ready, 180, "the ready line")
        addr = next(line for line in lines if "ready" in line).split("router at ")[1].split()[0]
        children = descendants(proc.pid)
        assert len(children) >= 5  # redis, pool node, prefill, decode, router
        ready = next(line for line in lines if "ready" in line)
        url_file = tmp_path / "logs" / "redis-url"
        redis_url = url_file.read_text().strip()  # redis://:PASSWORD@HOST:PORT/0, owner-only file
        password = redis_url.split("://:")[1].split("@")[0]
        assert ready.split("(redis ")[1].split(",")[0] == redis_url.replace(password, "***")
        assert (url_file.stat().st_mode & 0o777) == 0o600
        api = ready.split("OpenAI API at ")[1].split(",")[0]  # http://HOST:PORT/v1
        with urllib.request.urlopen(api + "/models", timeout=10) as reply:
            assert json.load(reply)["data"][0]["id"] == tiny_model_dir.name  # never the path
        with Client(addr) as client:
            got = client.generate(
                build_request("def fibonacci(n):", max_tokens=8, temperature=0.0), timeout=60
            )
            assert got.finished.output_tokens == 8
            # `kvferry scale` against the running cluster, with requests in flight both ways
            with ThreadPoolExecutor(4) as pool:
                long = build_request("def fibonacci(n):", max_tokens=150, temperature=0.0, ignore_eos=True)
                first = [pool.submit(client.generate, long, 120) for _ in range(2)]
                assert scale(url_file, "--decode", "2")["groups"]["decode"] == ["decode-0", "decode-1"]
                assert client.model_info().num_decode_workers == 2
                second = [pool.submit(client.generate, long, 120) for _ in range(2)]
                assert scale(url_file, "--decode", "1")["groups"]["decode"] == ["decode-0"]
                outputs = [f.result().finished.output_tokens for f in first + second]
            assert outputs == [150] * 4  # nothing lost, on the way up or down
            assert client.model_info().num_decode_workers == 1
            nobody = subprocess.run(
                [sys.executable, "-m", "kvferry.cli", "scale", "--redis-url", redis_url, "--namespace", "x"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert nobody.returncode == 2 and "no kvferry up serves namespace 'x'" in nobody.stderr
            # SIGTERM with requests in flight: the workers drain before the router goes. Long enough
            # (seconds of decode) to be seen in flight by the heartbeat (1 s) that the loop below reads:
            # with 1500 tokens of the tiny model one CI run never saw both (ended between beats, likely)
            longer = build_request("def fibonacci(n):", max_tokens=3000, temperature=0.0, ignore_eos=True)
            with ThreadPoolExecutor(2) as pool:
                last = [pool.submit(client.generate, longer, 120) for _ in range(2)]
                meta = MetadataStore(redis_url, "default")
                wait_for(
                    lambda: meta.members("decode").get("decode-0", {}).get("inflight", 0) >= 2,
                    30,
                    "the requests to reach the decode worker",
                )
                proc.send_signal(signal.SIGTERM)
                assert [f.result().finished.output_tokens for f in last] == [3000, 3000]
        assert proc.wait(60) == 0
        output = "".join(lines) + proc.stderr.read()
        assert password not in output and "restart" not in output  # a clean stop restarts nothing
    finally:
        if proc.poll() is None:  # a failed assertion above: take the cluster down anyway
            proc.kill()  # its children die with it (PR_SET_PDEATHSIG)
            proc.wait()
    wait_for(lambda: not [pid for pid in children if process_alive(pid)], 10, "no processes left behind")
    assert os.listdir(tmp_path / "logs")  # each component logged
    assert (
        not (tmp_path / "logs" / "redis-url").exists() and not (tmp_path / "logs" / "cluster-secret").exists()
    )


def self_signed_cert(out: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (and localhost), its own root."""
    cert, key = out / "cert.pem", out / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@contextlib.contextmanager
def up(*flags: str, env: dict | None = None):
    """`kvferry up <flags> --port 0 --no-http` for the block: (its process, the router's address) once the
    ready line came. A block that ends normally stops it with SIGTERM, which must exit 0; one that
    fails kills it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvferry.cli", "up", *flags, "--port", "0", "--no-http"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        ready = proc.stdout.readline()  # blocks until the ready line (or EOF if up failed)
        assert "ready" in ready, f"kvferry up ended: {proc.wait(60)}"
        yield proc, ready.split("router at ")[1].split()[0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_with_an_api_key_and_tls_serves_only_clients_with_the_key(tiny_model_dir, tmp_path):
    """The key reaches the router by its environment (not its command line), the launcher's readiness
    probe gets through TLS and the key gate, and `kvferry generate --server` sends the key."""
    cert, key = self_signed_cert(tmp_path)
    env = {**os.environ, "KVFERRY_API_KEY": "the-key"}
    env.pop("KVFERRY_CLUSTER_SECRET", None)
    flags = ("--model", str(tiny_model_dir), "--log-dir", str(tmp_path / "logs"))
    with up(*flags, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), env=env) as (proc, addr):
        router = next(pid for pid in descendants(proc.pid) if b"kvferry.router" in _proc(pid, "cmdline"))
        assert b"the-key" not in _proc(router, "cmdline")
        assert b"KVFERRY_API_KEY=the-key" in _proc(router, "environ").split(b"\0")
        generate = [
            *(sys.executable, "-m", "kvferry.cli", "generate", "--server", addr, "--prompt", "def f(n):"),
            *("--max-tokens", "4", "--ssl-ca-certs", str(cert)),
        ]
        client_env = {k: v for k, v in env.items() if k != "KVFERRY_API_KEY"}
        refused = subprocess.run(generate, capture_output=True, text=True, timeout=120, env=client_env)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
        served = subprocess.run(
            [*generate, "--api-key", "the-key"], capture_output=True, text=True, timeout=120, env=client_env
        )
        assert served.returncode == 0 and "output=4" in served.stderr, served.stderr


def _proc(pid: int, what: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes()
    except OSError:
        return b""


def test_up_serves_a_five_expert_checkpoint_with_expert_parallelism_of_two(
    five_expert_model_dir, tmp_path, hf_greedy, monkeypatch
):
    """`kvferry up --decode-expert-parallel-size 2` on 5 experts: ranks hold 3 | 2 (the uneven map) and
    greedy output equals transformers' token for token; the group reports its load per global expert."""
    flags = ("--model", str(five_expert_model_dir), "--log-dir", str(tmp_path / "logs"))
    with up(*flags, "--dtype", "float32", "--decode-expert-parallel-size", "2") as (_, addr):
        prompts = [[(7 * i + 3 * j) % 500 + 10 for j in range(n)] for i, n in enumerate((5, 19, 33, 40))]
        reference = hf_greedy(five_expert_model_dir, prompts, 12)
        with Client(addr) as client, ThreadPoolExecutor(4) as pool:
            requests = [
                build_request(prompt_token_ids=ids, max_tokens=12, temperature=0.0, ignore_eos=True)
                for ids in prompts
            ]
            got = list(pool.map(lambda r: client.generate(r, 120).token_ids, requests))
        assert got == reference
        redis_url = (tmp_path / "logs" / "redis-url").read_text().strip()
        ranks = MetadataStore(redis_url, "default").members("decode")
        assert sorted(ranks) == ["decode-0.r0", "decode-0.r1"]
        # the group's expert load, as any rank reports it (internal calls carry up's cluster secret)
        monkeypatch.setenv(SECRET_ENV, (tmp_path / "logs" / "cluster-secret").read_text().strip())
        with rpc.channel(ranks["decode-0.r1"]["addr"]) as channel:
            stats = worker_pb2_grpc.DecodeWorkerStub(channel).GetStats(
                worker_pb2.WorkerStatsRequest(), timeout=10
            )
        load = stats.expert_load
        assert stats.expert_parallel_size == 2 and list(load.rank_experts) == [3, 2]
        assert len(load.layers) == 2 and all(len(layer.tokens) == 5 for layer in load.layers)
        assert sum(load.rank_tokens) == sum(sum(layer.tokens) for layer in load.layers) > 0
        assert all(t > 0 for t in load.rank_tokens) and 0 < load.expert_balance <= 1
