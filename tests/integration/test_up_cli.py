"""`kvferry up` as a user runs it: ready line, a request, `kvferry scale`, SIGTERM, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvferry.kvpool.metadata import MetadataStore
from kvferry.router.client import Client, build_request

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


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def scale(redis_url: str, *counts: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "kvferry.cli", "scale", "--redis-url", redis_url, *counts],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


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
        deadline = time.monotonic() + 180
        while not any("ready" in line for line in lines):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no ready line"
            time.sleep(0.1)
        addr = next(line for line in lines if "ready" in line).split("router at ")[1].split()[0]
        children = descendants(proc.pid)
        assert len(children) >= 5  # redis, pool node, prefill, decode, router
        ready = next(line for line in lines if "ready" in line)
        redis_url = ready.split("(redis ")[1].split(",")[0]
        api = ready.split("OpenAI API at ")[1].split(",")[0]  # http://HOST:PORT/v1
        with urllib.request.urlopen(api + "/models", timeout=10) as reply:
            assert json.load(reply)["data"][0]["id"] == str(tiny_model_dir)
        with Client(addr) as client:
            got = client.generate(
                build_request("def fibonacci(n):", max_tokens=8, temperature=0.0), timeout=60
            )
            assert got.finished.output_tokens == 8
            # `kvferry scale` against the running cluster, with requests in flight both ways
            with ThreadPoolExecutor(4) as pool:
                long = build_request("def fibonacci(n):", max_tokens=150, temperature=0.0, ignore_eos=True)
                first = [pool.submit(client.generate, long, 120) for _ in range(2)]
                assert scale(redis_url, "--decode", "2")["groups"]["decode"] == ["decode-0", "decode-1"]
                assert client.model_info().num_decode_workers == 2
                second = [pool.submit(client.generate, long, 120) for _ in range(2)]
                assert scale(redis_url, "--decode", "1")["groups"]["decode"] == ["decode-0"]
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
            # (seconds of decode) to be seen in flight by the heartbeat that the loop below reads.
            longer = build_request("def fibonacci(n):", max_tokens=1500, temperature=0.0, ignore_eos=True)
            with ThreadPoolExecutor(2) as pool:
                last = [pool.submit(client.generate, longer, 120) for _ in range(2)]
                meta = MetadataStore(redis_url, "default")
                deadline = time.monotonic() + 30
                while meta.members("decode").get("decode-0", {}).get("inflight", 0) < 2:
                    assert time.monotonic() < deadline, "the requests never reached the decode worker"
                    time.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                assert [f.result().finished.output_tokens for f in last] == [1500, 1500]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:  # a failed assertion above: take the cluster down anyway
            proc.kill()  # its children die with it (PR_SET_PDEATHSIG)
            proc.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)], "processes left behind"
    assert os.listdir(tmp_path / "logs")  # each component logged
