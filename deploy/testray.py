"""Ray across emulated hosts (`testhosts.py`): a multi-node Ray cluster and `kvferry up --ray` on it, as an
operator runs them on real machines, for the multi-host tests and benchmarks.

- `ray start --head` on one host and `ray start --address HEAD:6379` on the others, each with its own
  `--node-ip-address` (the host's address on the cluster network, never loopback) and the custom
  resources that pin kvferry's groups to it (a group's `resources: {prefill_host: 1}` lands on the node
  that offers `prefill_host`).
- Ray's token authentication is on (`RAY_AUTH_MODE=token`) and the token reaches every node and every
  driver in `RAY_AUTH_TOKEN`; on real machines copy the file `ray get-auth-token --generate` wrote
  (~/.ray/auth_token) to each node instead (docs/multihost.md).
- Ray's own TLS is on (`RAY_USE_TLS=1`, a CA of its own and one certificate naming every host): kvferry's
  controller hands each process its secret and TLS key through Ray's RPC, which is plaintext otherwise.
- Every host sees `shared` (a directory outside the hosts' private /tmp), as machines see a shared file
  system: the model, the kvferry cache (built kernels) and the cluster file live there.
- The driver (`kvferry up --ray --detach`, `kvferry scale --ray`, `kvferry down --ray`) runs on the head
  host: a Ray driver needs a raylet on its own machine.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.deploy.testhosts import HostsError, TestHosts

RAY_PORT = 6379
READY = re.compile(r"ready: router at (\S+)")
ANSWER = "kvferry-answer:"


@dataclass(frozen=True)
class RayNode:
    """What one host offers Ray: CPUs and custom resources (e.g. {"prefill_host": 1})."""

    num_cpus: int = 2
    resources: dict = field(default_factory=dict)


class RayOnHosts:
    """A Ray cluster over `hosts`: its head on host `head`; `start` adds a node per host."""

    def __init__(self, hosts: TestHosts, shared: Path, head: int = 1):
        self.hosts, self.shared, self.head = hosts, Path(shared), head
        self.token = secrets.token_hex(32)
        self.env = {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "KVFERRY_CACHE_DIR": str(self.shared / "cache"),
            "RAY_USAGE_STATS_ENABLED": "0",
            **self._ray_tls(),
        }
        self.started: list[int] = []

    def _ray_tls(self) -> dict[str, str]:
        """Ray's TLS: a CA and one leaf for every host's address (Ray checks the address it dials)."""
        from kvferry.deploy.cluster_ca import ClusterCA
        from kvferry.deploy.redis_server import write_private

        tls = ClusterCA.create().issue([h.address for h in self.hosts.hosts] + ["127.0.0.1", "localhost"])
        where = self.shared / "ray-tls"
        where.mkdir(mode=0o700, exist_ok=True)
        files = {
            "RAY_TLS_CA_CERT": ("ca.pem", tls.ca),
            "RAY_TLS_SERVER_CERT": ("cert.pem", tls.cert),
            "RAY_TLS_SERVER_KEY": ("key.pem", tls.key),
        }
        env = {"RAY_USE_TLS": "1"}
        for name, (file, pem) in files.items():
            env[name] = str(write_private(where / file, pem.decode()))
        return env

    @property
    def address(self) -> str:
        return f"{self.hosts[self.head].address}:{RAY_PORT}"

    def run(
        self, index: int, argv: list[str], timeout: float = 300, check: bool = True, env: dict | None = None
    ):
        """Run `argv` on host `index` with the cluster's environment (the Ray token)."""
        import os

        return self.hosts[index].run(
            argv, timeout=timeout, check=check, env={**os.environ, **self.env, **(env or {})}
        )

    def start(self, nodes: dict[int, RayNode]) -> RayOnHosts:
        """One Ray node per host in `nodes` (the head's entry is required and starts first)."""
        common = ["--disable-usage-stats", "--object-store-memory", str(200 * 2**20)]
        for index in sorted(nodes, key=lambda i: i != self.head):
            node, host = nodes[index], self.hosts[index]
            where = ["--head", f"--port={RAY_PORT}"] if index == self.head else [f"--address={self.address}"]
            argv = [
                "ray",
                "start",
                *where,
                f"--node-ip-address={host.address}",
                f"--num-cpus={node.num_cpus}",
                f"--resources={json.dumps(node.resources)}",
                *common,
            ]
            self.run(index, argv, timeout=120)
            self.started.append(index)
        return self

    def stop(self) -> None:
        """`ray stop --force` on every node (the hosts' teardown ends whatever is left)."""
        for index in reversed(self.started):
            with contextlib.suppress(subprocess.TimeoutExpired, HostsError):
                self.run(index, ["ray", "stop", "--force"], timeout=60, check=False)
        self.started = []

    def kvferry_up(self, config: Path, timeout: float = 300) -> str:
        """`kvferry up --ray --detach` from the head host; returns the router's address."""
        done = self.run(
            self.head,
            ["kvferry", "up", "--ray", "--detach", "--address", self.address, "--config", str(config)],
            timeout=timeout,
            check=False,
        )
        found = READY.search(done.stdout + done.stderr)
        if done.returncode != 0 or found is None:
            raise HostsError(f"kvferry up --ray failed ({done.returncode}): {done.stderr[-3000:]}")
        return found.group(1)

    def controller(self, namespace: str, method: str):
        """Call the kvferry controller's `method` (status, full_redis_url) from the head host; its
        JSON-able answer."""
        code = (
            "import json, ray; from kvferry.deploy import ray_launch; "
            f"ray_launch.connect({self.address!r}, log_to_driver=False); "
            f"c = ray_launch.get_controller({namespace!r}); "
            f"print({ANSWER!r}, json.dumps(ray.get(c.{method}.remote(), timeout=60)))"
        )
        done = self.run(self.head, [sys.executable, "-c", code], timeout=120)
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith(ANSWER))  # Ray logs here too
        return json.loads(line[len(ANSWER) :])

    def kvferry(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        """`kvferry ARGS --address HEAD` on the head host (scale, down)."""
        return self.run(
            self.head, ["kvferry", *args, "--address", self.address], timeout=timeout, check=check
        )
