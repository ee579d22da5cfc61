"""Unit-test fixtures: an in-process engine on a built-in model, and a redis-server of their own."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch

from kvferry.deploy.redis_server import redis_server_argv, wait_for_redis
from kvferry.engine.engine import EngineConfig, LLMEngine
from kvferry.proc import free_port

# the engine the unit tests run unless they say otherwise: float32 (exact against the references), a
# small KV cache and max length (fast to allocate; the tests' prompts fit)
ENGINE_DEFAULTS = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64}


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The unit tests run torch ops on one thread; the value: torch's own count, restored at the end.

    The tiny model's ops are far too small to gain from a second thread, and an OpenMP team whose other
    core is busy (another process, another test run) makes every parallel region wait for it: on this
    2-core machine, shared, the engine tests of this directory took 105 s with two threads and 7 s with
    one. The kernels' own tests take `all_torch_threads`, so their parallel paths stay tested."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield threads
    torch.set_num_threads(threads)


@pytest.fixture()
def all_torch_threads(one_torch_thread):
    """For a test of the kernels' parallel paths: torch's own thread count while it runs."""
    torch.set_num_threads(one_torch_thread)
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def make_engine(tiny_model_dir):
    """`make_engine(model_dir=None, detokenize=True, **settings)`: a new `LLMEngine` on `model_dir` (the
    tiny model by default) with ENGINE_DEFAULTS and `settings` (any EngineConfig field; one given as None
    takes EngineConfig's own default). Session-scoped, so module-scoped fixtures can share one engine."""

    def make(model_dir: Path | None = None, detokenize: bool = True, **settings) -> LLMEngine:
        model = str(model_dir or tiny_model_dir)
        given = {k: v for k, v in (ENGINE_DEFAULTS | settings).items() if v is not None}
        cfg = EngineConfig(model=model, **given)
        return LLMEngine(cfg, detokenize=detokenize)

    return make


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A redis-server of the module's own (the unit tests that publish to or read from Redis)."""
    port = free_port()
    argv = redis_server_argv("127.0.0.1", port, tmp_path_factory.mktemp("redis"))
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_redis("127.0.0.1", port, time.monotonic() + 20)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
