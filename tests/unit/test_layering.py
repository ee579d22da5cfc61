"""The rooms' import graph (docs/architecture.md, "Rooms"): every kvferry import in every module,
function-level ones included, points down the table; nothing in engine/ or model/ reaches up to a
worker, the router, a launcher or the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# room -> its source directory (the package kvferry.<room>; kvferry/ itself holds the shared modules)
ROOMS = {
    "kernels": "kernels",
    "model": "model",
    "engine": "engine",
    "kvpool": "kvpool",
    "worker": "kvferry/worker",
    "prefill_worker": "prefill_worker",
    "decode_worker": "decode_worker",
    "router": "router",
    "loadtest": "loadtest",
    "deploy": "deploy",
}
# the shared modules in kvferry/ (each its own room: they sit at the bottom, beside the protobufs)
BASE = {"kvferry.settings", "kvferry.proc", "kvferry.rpc", "kvferry.auth", "kvferry.flags", "kvferry.v1"}

# what each room may import (besides itself and BASE); kvferry.convert is the API <-> engine adapter
ALLOWED = {
    "kernels": set(),
    "model": {"kernels"},
    "engine": {"model", "kernels"},
    # the Triton block pack/unpack for a cache on CUDA; the block keys (the prefix cache's hashes)
    "kvpool": {"kernels", "kvferry.engine.block_hash"},
    "worker": {"engine", "model", "kvpool"},
    "prefill_worker": {"worker", "engine", "model", "kvpool", "kvferry.convert"},
    "decode_worker": {"worker", "engine", "model", "kvpool", "kvferry.convert"},
    "router": {"engine", "model", "kvpool", "kvferry.convert"},
    "loadtest": {"router"},
    # a worker's own settings (import-light): the launchers spell its argv from them
    "deploy": {"engine", "model", "kvpool", "router", "kvferry.worker.config"},
}
UPWARD = {"worker", "prefill_worker", "decode_worker", "router", "deploy", "loadtest", "kvferry.cli"}


def kvferry_imports(path: Path) -> set[str]:
    """Every kvferry module `path` imports, at any depth (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m == "kvferry" or m.startswith("kvferry.")}


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ROOMS:
        return parts[1]
    return ".".join(parts[:2])  # kvferry.<shared module>


def allowed(room: str, module: str) -> bool:
    target = room_of(module)
    if target == room or target in BASE:
        return True
    rules = ALLOWED[room]
    return target in rules or any(module == r or module.startswith(r + ".") for r in rules)


def edges(room: str) -> list[tuple[str, str]]:
    files = sorted((ROOT / ROOMS[room]).glob("*.py"))
    assert files, f"no modules found for room {room}"
    return [(f.relative_to(ROOT).as_posix(), m) for f in files for m in sorted(kvferry_imports(f))]


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_imports_point_down(room):
    bad = [f"{src} -> {module}" for src, module in edges(room) if not allowed(room, module)]
    assert not bad, "imports against the rooms' order (docs/architecture.md):\n" + "\n".join(bad)


@pytest.mark.parametrize("room", ["engine", "model", "kernels"])
def test_engine_and_model_import_nothing_above_them(room):
    up = [f"{src} -> {module}" for src, module in edges(room) if room_of(module) in UPWARD]
    assert not up, "\n".join(up)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checks above could fail: a module importing a worker is caught, function-level too."""
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from kvferry.decode_worker.worker import DecodeWorker\n")
    (module,) = kvferry_imports(path)
    assert room_of(module) == "decode_worker" and not allowed("engine", module)
    assert not allowed("model", "kvferry.engine.engine") and allowed("engine", "kvferry.model.config")
    assert allowed("kvpool", "kvferry.engine.block_hash") and not allowed("kvpool", "kvferry.engine.engine")
    assert not allowed("engine", "kvferry.kvpool.transfer")


# the engine's internals: a worker or the pool reaches the engine only through its public methods and
# its KV hand-off API (engine/kv_handoff.py)
ENGINE_INTERNALS = {"block_manager", "scheduler", "runner", "states", "finish_hook", "step_hook"}
HANDOFF_USERS = ["worker", "prefill_worker", "decode_worker", "kvpool"]


def internal_uses(path: Path) -> list[str]:
    """`x.<internal>` attribute uses in `path` (on any object: these rooms have no fields of those names)."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path.name}:{node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS
    ]


@pytest.mark.parametrize("room", HANDOFF_USERS)
def test_workers_use_the_engine_handoff_api(room):
    files = sorted((ROOT / ROOMS[room]).glob("*.py"))
    bad = [f"{ROOMS[room]}/{use}" for f in files for use in internal_uses(f)]
    assert not bad, "engine internals used outside the engine (use LLMEngine.kv):\n" + "\n".join(bad)


def test_the_checker_sees_an_internal_use(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("def f(engine):\n    return engine.block_manager.num_free_blocks + len(engine.states)\n")
    assert internal_uses(path) == ["bad.py:2: .block_manager", "bad.py:2: .states"]
