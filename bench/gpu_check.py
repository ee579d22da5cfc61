"""GPU check: the Triton kernels, the engine and the KV hand-off on one CUDA machine, in one command.

Sections (each in its own process with its own time limit, so a crash, a hang or a sticky CUDA error in
one is recorded and the next still runs; an exception is recorded as {"error": ...}):

- triton: each Triton kernel (paged decode and prefill attention, top-k routing, fused MoE, W8A8 GEMM,
  KV block pack/unpack) against its torch reference on CUDA: max error against the float32 reference
  (W8A8 and pack/unpack: bit-exact), and CUDA-event times (median after warm-ups) of both.
- engine: greedy parity of `LLMEngine` on CUDA (float32, Triton kernels) with `transformers` on CUDA
  for the tiny model and the hidden-style checkpoint (tests/conftest.py SECOND_SPEC: 3 layers, a dense
  layer, tied embeddings, top-3 without renormalisation, sharded safetensors); the bench model's decode
  step time against the HBM roofline (weight bytes per step / device-to-device copy bandwidth) at batch
  1 and 32, and its prefill tokens/s. The checkpoints are made locally (seeded weights, no downloads)
  under the kvferry cache (KVFERRY_CACHE_DIR).
- handoff: KV blocks handed between two processes on one GPU, both ways, bytes checked: CUDA IPC (a
  CUDA tensor shared through torch.multiprocessing, spawn) and host staging (shared, pinned host
  memory), at a few MB and at 64 MB.
- nccl: a 2-process NCCL send/recv round trip of KV blocks (needs 2 GPUs; else recorded as skipped).

Without CUDA it prints `gpu_check: no CUDA device (torch.cuda.is_available() is False)`; with
TRITON_INTERPRET=1 it then runs the Triton parity checks on CPU tensors under Triton's interpreter at
small sizes (no speed figures); the other sections are recorded as skipped. `--device cpu` runs every
section on the CPU (a dry run of this script's code paths; the figures are not GPU figures).

The whole run stays within --budget-s (default 420 s): each section gets its share, a section with too
little time left is recorded as skipped, and one past its limit is killed (what it finished is kept).
Last line of stdout: one JSON object. A markdown report goes to --report (default
gpu_check_report.md in $OUT if set, else in the current directory).

    python bench/gpu_check.py [--budget-s 420] [--sections triton,engine,handoff,nccl] [--quick]
                              [--report PATH] [--out PATH] [--device cuda|cpu]
    TRITON_INTERPRET=1 python bench/gpu_check.py --sections triton --quick   # on a CPU machine
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from unittest import mock

import torch

REPO = Path(__file__).resolve().parents[1]


def _kvferry_importable() -> bool:
    try:
        return importlib.util.find_spec("kvferry.model") is not None
    except ImportError:  # `kvferry` itself is missing (or its editable finder points elsewhere)
        return False


if not _kvferry_importable():
    # not installed (or a stale install): import this checkout as pyproject's package-dir maps it,
    # kvferry.<room> = <repo>/<room> (kvferry.model = model/, kvferry.kernels = kernels/, ...)
    for _name in [m for m in sys.modules if m == "kvferry" or m.startswith("kvferry.")]:
        del sys.modules[_name]
    sys.path.insert(0, str(REPO))
    import kvferry

    kvferry.__path__.append(str(REPO))

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    from common import bench_model_dir, full_batch_step_ms, memcpy_gbps, print_result, weight_bytes_per_step

    COMMON_ERROR = None
except ImportError as _err:  # a bare machine (kvferry.model.create needs safetensors and jinja2): the
    # Triton and hand-off sections need only torch and triton, so they still run
    COMMON_ERROR = f"bench/common.py does not import: {type(_err).__name__}: {_err}"

NO_CUDA_LINE = "gpu_check: no CUDA device (torch.cuda.is_available() is False)"
SECTIONS = ("triton", "engine", "handoff", "nccl")
# each section's share of the default 420 s budget (scaled with --budget-s); a section may also use what
# the ones before it left unused, as long as the ones after it keep their shares
BUDGETS = {"triton": 140.0, "engine": 170.0, "handoff": 60.0, "nccl": 50.0}
MIN_SECTION_S = 20.0  # a section with less than this left is recorded as skipped
PACKAGES = ("torch", "triton", "transformers", "safetensors", "tokenizers", "jinja2", "numpy", "grpcio")


def log(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:2000]


def clean(obj):
    """`obj` with NaN/inf floats as strings (JSON has neither), tuples as lists, dtypes as names."""
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [clean(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    return obj


def rounded(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


# ---------------------------------------------------------------- environment


def cpu_summary() -> dict:
    """CPU model and the flags that decide which kernels serve (bench/common.reported_cpu_flags' list,
    plus amx_tile), read from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu_model": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
    return {
        "cpu_model": fields.get("model name", platform.processor()),
        "cpu_count": os.cpu_count(),
        "cpu_flags": [f for f in wanted if f in flags],
        "amx": any(f.startswith("amx") for f in flags),
    }


def environment(cuda: bool) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "packages": {},
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        **cpu_summary(),
    }
    for name in PACKAGES:
        try:
            env["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env["packages"][name] = None
    env["triton"] = env["packages"]["triton"]
    env["cuda"] = cuda
    if cuda:
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        env |= {
            "gpu": torch.cuda.get_device_name(0),
            "gpu_count": count,
            "gpus": [torch.cuda.get_device_name(i) for i in range(count)],
            "capability": "{}.{}".format(*torch.cuda.get_device_capability(0)),
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "sm_count": props.multi_processor_count,
        }
    if COMMON_ERROR:
        env["common_error"] = COMMON_ERROR
    return env


# ---------------------------------------------------------------- section plumbing


@dataclass
class Ctx:
    """What a section process runs with; `save()` writes the results so far (a killed section keeps them)."""

    device: torch.device
    quick: bool
    deadline: float  # time.time() by which the section must be done
    result_file: Path | None
    result: dict = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        if self.result_file is None:
            return
        tmp = self.result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(clean(self.result)))
        os.replace(tmp, self.result_file)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def time_ms(ctx: Ctx, fn, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of `fn()`: CUDA events around each call on CUDA (after `warmup` calls and a
    synchronize), perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    ctx.sync()
    if ctx.device.type != "cuda":
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(ctx.device)
    return statistics.median([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])


def cuda_copy_gbps(device: torch.device, nbytes: int = 2**30, repeats: int = 10) -> float:
    """HBM bandwidth: best-of-N device-to-device copy, counting bytes read + written (as common.memcpy_gbps
    does on the CPU)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / best / 1e9


def run_section(name: str, timeout: float, args) -> dict:
    """Run section `name` in a child process (its own session, so the whole process group is killed on a
    timeout, spawned helpers included); its output goes to our stderr. Returns its result dict."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        result_file = Path(tmp) / "result.json"
        deadline = time.time() + timeout - 5  # 5 s for the child to write its result and exit
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            name,
            "--result-file",
            str(result_file),
        ]
        argv += ["--deadline", repr(deadline), "--device", args.device] + (["--quick"] if args.quick else [])
        log(f"section {name}: start (limit {timeout:.0f} s)")
        proc = subprocess.Popen(argv, stdout=sys.stderr.fileno(), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        with contextlib.suppress(ProcessLookupError):  # the group: the child and anything it spawned
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        try:
            result = json.loads(result_file.read_text())
        except (OSError, ValueError):
            result = {}
    if rc is None:
        result["error"] = f"timed out after {timeout:.0f} s (killed; the results it saved are kept)"
    elif rc != 0 and "error" not in result:
        result["error"] = f"section process exited with status {rc}"
    result["wall_s"] = round(time.monotonic() - start, 1)
    log(
        f"section {name}: done in {result['wall_s']} s"
        + (f" ({result['error']})" if "error" in result else "")
    )
    return result


def run_child(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda":  # an explicit index: torch.cuda.set_device and friends reject a bare "cuda"
        device = torch.device("cuda", torch.cuda.current_device())
    ctx = Ctx(device, args.quick, args.deadline, Path(args.result_file))
    section = {
        "triton": section_triton,
        "engine": section_engine,
        "handoff": section_handoff,
        "nccl": section_nccl,
    }
    try:
        section[args.child](ctx)
    except Exception as err:
        traceback.print_exc()
        ctx.result["error"] = error_text(err)
    ctx.save()
    return 0


# ---------------------------------------------------------------- triton kernels

TOL = {
    torch.float32: (1e-4, 1e-4),  # IEEE tl.dot; the observed error is ~1e-6
    torch.float16: (2e-2, 2e-2),  # 16-bit inputs, rounded intermediates (tests/unit/test_triton_kernels.py)
    torch.bfloat16: (5e-2, 5e-2),  # 3 fewer mantissa bits than float16
}
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def compare(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> dict:
    """Max abs error of `out` against `ref` and whether every element is within atol + rtol * |ref|."""
    out, ref = out.float(), ref.float()
    diff = (out - ref).abs()
    within = bool(torch.all(diff <= atol + rtol * ref.abs()).item()) if diff.numel() else True
    max_err = diff.max().item() if diff.numel() else 0.0
    return {"max_abs_err": max_err, "atol": atol, "rtol": rtol, "ok": within}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, int]:
    """(bit-identical, number of differing elements): NaN payloads compared as bits."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, -1
    differ = int((bits(a) != bits(b)).sum().item())
    return differ == 0, differ


def speed(ctx: Ctx, timed: bool, triton_fn, torch_fn, prefix: str = "") -> dict:
    """{triton_ms, torch_ms, speedup} (keys prefixed), or {} where speed is not measured."""
    if not timed:
        return {}
    ours, ref = time_ms(ctx, triton_fn), time_ms(ctx, torch_fn)
    return {
        f"{prefix}triton_ms": rounded(ours),
        f"{prefix}torch_ms": rounded(ref),
        f"{prefix}speedup": rounded(ref / ours, 3),
    }


def randn(
    g: torch.Generator, shape, dtype: torch.dtype, device: torch.device, std: float = 1.0
) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=device) * std).to(dtype)


def case_decode_attention(ctx, timed, dtype, batch, hq, hkv, d, bs, max_len):
    from kvferry.kernels import triton_attention as ta
    from kvferry.kernels.paged_attention import paged_decode_attention_reference

    dev, cpu_g = ctx.device, torch.Generator().manual_seed(1)
    g = torch.Generator(device=dev).manual_seed(1)
    width = -(-max_len // bs)
    num_blocks = batch * width + 7
    k_cache, v_cache = (randn(g, (hkv, num_blocks, bs, d), dtype, dev) for _ in range(2))
    lens = torch.randint(1, max_len + 1, (batch,), generator=cpu_g)
    lens[0], lens[-1] = 1, max_len
    lens = lens.to(dev)
    tables = torch.randperm(num_blocks, generator=cpu_g)[: batch * width].view(batch, width).to(dev)
    q = randn(g, (batch, hq, d), dtype, dev)
    scale = d**-0.5
    out = ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    ref = paged_decode_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    entry = compare(out, ref, *TOL[dtype])
    del ref
    buf = torch.empty_like(q)
    entry |= speed(
        ctx,
        timed,
        lambda: ta.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, out=buf),
        lambda: paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale),
    )
    return {"shape": f"B={batch} Hq={hq} Hkv={hkv} D={d} bs={bs} ctx<={max_len}", **entry}


def case_prefill_attention(ctx, timed, dtype, q_lens, prefixes, hq, hkv, d, bs):
    from kvferry.kernels import triton_attention as ta

    dev, cpu_g = ctx.device, torch.Generator().manual_seed(2)
    g = torch.Generator(device=dev).manual_seed(2)
    contexts = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    chunks, width = len(q_lens), -(-max(contexts) // bs)
    num_blocks = chunks * width + 5
    k_cache, v_cache = (randn(g, (hkv, num_blocks, bs, d), dtype, dev) for _ in range(2))
    tables = torch.randperm(num_blocks, generator=cpu_g)[: chunks * width].view(chunks, width).to(dev)
    starts = [sum(q_lens[:i]) for i in range(chunks)]  # the chunks back to back: every row is covered
    q = randn(g, (sum(q_lens), hq, d), dtype, dev)
    q_starts, lens, ctx_lens = (
        torch.tensor(v, dtype=torch.int64, device=dev) for v in (starts, q_lens, contexts)
    )
    scale = d**-0.5
    args = (tables, q_starts, lens, ctx_lens, scale)
    out = ta.paged_prefill_attention(q, k_cache, v_cache, *args, max_q_len=max(q_lens))
    ref = ta.paged_prefill_attention_reference(q.float(), k_cache.float(), v_cache.float(), *args)
    entry = compare(out, ref, *TOL[dtype])
    del ref
    buf = torch.empty_like(q)
    entry |= speed(
        ctx,
        timed,
        lambda: ta.paged_prefill_attention(q, k_cache, v_cache, *args, max_q_len=max(q_lens), out=buf),
        lambda: ta.paged_prefill_attention_reference(q, k_cache, v_cache, *args),
    )
    shape = f"chunks q_len={q_lens} prefix={prefixes} Hq={hq} Hkv={hkv} D={d} bs={bs}"
    return {"shape": shape, **entry}


def case_route(ctx, timed, dtype, tokens, hidden, experts, top_k):
    from kvferry.kernels import triton_moe as tm
    from kvferry.model.moe import route

    g = torch.Generator(device=ctx.device).manual_seed(4)
    x, router = randn(g, (tokens, hidden), dtype, ctx.device), randn(g, (hidden, experts), dtype, ctx.device)
    weights, ids = tm.route_topk(x @ router, top_k, True)
    ref_weights, ref_ids = route(x, router, top_k, True)
    entry = compare(weights, ref_weights, 1e-5, 1e-5)
    ids_agree = float((ids == ref_ids).float().mean().item())
    entry |= {"ids_agree": ids_agree, "ok": entry["ok"] and ids_agree == 1.0}  # random logits: no ties
    entry |= speed(
        ctx, timed, lambda: tm.route_topk(x @ router, top_k, True), lambda: route(x, router, top_k, True)
    )
    return {"shape": f"T={tokens} H={hidden} E={experts} k={top_k} renormalize", **entry}


def case_fused_moe(ctx, timed, dtype, tokens, hidden, inter, experts, top_k):
    from kvferry.kernels import triton_moe as tm
    from kvferry.model.moe import experts_forward, route

    dev, g = ctx.device, torch.Generator(device=ctx.device).manual_seed(6)
    x = randn(g, (tokens, hidden), dtype, dev)
    weights, ids = route(x.float(), randn(g, (hidden, experts), torch.float32, dev), top_k, True)
    weights = weights.to(dtype)
    w13 = randn(g, (experts, hidden, 2 * inter), dtype, dev, hidden**-0.5)
    w2 = randn(g, (experts, inter, hidden), dtype, dev, inter**-0.5)
    out = tm.fused_moe(x, ids, weights, w13, w2)
    ref = experts_forward(x.float(), ids, weights.float(), w13.float(), w2.float())
    entry = compare(out, ref, *TOL[dtype])
    del ref
    entry |= speed(
        ctx,
        timed,
        lambda: tm.fused_moe(x, ids, weights, w13, w2),
        lambda: experts_forward(x, ids, weights, w13, w2),
    )
    return {"shape": f"T={tokens} H={hidden} I={inter} E={experts} k={top_k}", **entry}


def case_w8a8(ctx, timed, dtype, m, k, n):
    from kvferry.kernels import triton_w8a8
    from kvferry.model import quant

    g = torch.Generator(device=ctx.device).manual_seed(m)
    x, w = randn(g, (m, k), dtype, ctx.device), randn(g, (k, n), torch.float32, ctx.device)
    q, scale = quant.quantize_weight(w)
    out = triton_w8a8.w8a8_linear(x, q, scale)
    ref = quant.w8a8_linear(x, q, scale)  # float64 sums: exact
    exact, differ = same_bits(out, ref)
    entry = compare(out, ref, 0.0, 0.0) | {"bit_exact": exact, "differing": differ}
    entry |= speed(
        ctx, timed, lambda: triton_w8a8.w8a8_linear(x, q, scale), lambda: quant.w8a8_linear(x, q, scale)
    )
    if timed:  # for scale: the dense GEMM these int8 weights stand in for
        dense = w.to(dtype)
        entry["dense_matmul_ms"] = rounded(time_ms(ctx, lambda: x @ dense))
    return {"shape": f"M={m} K={k} N={n}", **entry}


@contextlib.contextmanager
def torch_copies():
    """kvpool.transfer's strided torch copies even for a CUDA cache (where it would take the Triton
    kernels): the reference the pack/unpack kernels are timed against."""
    from kvferry.kvpool import transfer

    with mock.patch.object(transfer, "triton_pack_ops", lambda device: None):
        yield


def case_pack(ctx, timed, dtype, layers, heads, num_blocks, bs, d, n, head_begin, head_end):
    from kvferry.kernels import triton_pack as tp
    from kvferry.kvpool import transfer

    dev, cpu_g = ctx.device, torch.Generator().manual_seed(9)
    g = torch.Generator(device=dev).manual_seed(9)
    cache = randn(g, (layers, 2, heads, num_blocks, bs, d), dtype, dev)
    cache.view(-1)[::97] = float("nan")  # NaN payloads must travel unchanged
    ids = torch.randperm(num_blocks, generator=cpu_g)[:n].tolist()  # any order: few runs
    ids_t = torch.tensor(ids, dtype=torch.int64, device=dev)
    ours = tp.pack_blocks(cache, ids_t, head_begin, head_end)
    with torch_copies():
        ref = transfer.pack_blocks(cache, ids, head_begin, head_end)
    pack_exact, pack_differ = same_bits(ours, ref)
    data = randn(g, tuple(ref.shape), dtype, dev)
    mine, theirs = cache.clone(), cache.clone()
    tp.unpack_blocks(mine, ids_t, data, head_begin)
    with torch_copies():
        transfer.unpack_blocks(theirs, ids, data, head_begin)
    unpack_exact, unpack_differ = same_bits(mine, theirs)  # only the named blocks' head slice changed
    round_trip, _ = same_bits(tp.pack_blocks(mine, ids_t, head_begin, head_end), data)
    ok = pack_exact and unpack_exact and round_trip
    entry = {"bit_exact": ok, "ok": ok, "pack_differing": pack_differ, "unpack_differing": unpack_differ}
    entry["round_trip"] = round_trip
    nbytes = ref.numel() * ref.element_size()
    entry["mb"] = rounded(nbytes / 2**20)
    if timed:
        del theirs

        def torch_pack():
            with torch_copies():
                transfer.pack_blocks(cache, ids, head_begin, head_end, out=ref)

        def torch_unpack():
            with torch_copies():
                transfer.unpack_blocks(mine, ids, data, head_begin)

        entry |= speed(
            ctx, True, lambda: tp.pack_blocks(cache, ids_t, head_begin, head_end, out=ours), torch_pack
        )
        entry |= speed(
            ctx, True, lambda: tp.unpack_blocks(mine, ids_t, data, head_begin), torch_unpack, "unpack_"
        )
        entry["pack_gbps"] = rounded(2 * nbytes / (entry["triton_ms"] / 1e3) / 1e9)  # read + written
    shape = f"L={layers} H={heads} blocks={num_blocks} bs={bs} D={d}; {n} random blocks"
    return {"shape": f"{shape}, heads {head_begin}:{head_end}", **entry}


def triton_plan(mode: str) -> dict[str, list[tuple]]:
    """kernel -> [(case function, dtype, kwargs)] for mode "interpreter" (tiny shapes: every program runs
    in Python; float32 and float16 only, bfloat16 is broken in the interpreter except for pack/unpack,
    which moves integers), "quick" or "full" (CUDA; full: shapes of a Qwen3-30B-A3B-sized layer)."""
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    dec, pre, moe, pack = case_decode_attention, case_prefill_attention, case_fused_moe, case_pack
    if mode == "interpreter":
        small = dict(hq=8, hkv=2, d=32, bs=8)
        kv = dict(layers=3, heads=4, num_blocks=20, bs=8, d=16, n=6, head_begin=1, head_end=3)
        return {
            "decode_attention": [(dec, dt, dict(batch=4, max_len=29, **small)) for dt in (f32, f16)],
            "prefill_attention": [
                (pre, dt, dict(q_lens=[13, 9, 1, 20], prefixes=[0, 13, 34, 16], **small)) for dt in (f32, f16)
            ],
            "moe_route": [(case_route, f32, dict(tokens=19, hidden=32, experts=7, top_k=3))],
            "fused_moe": [
                (moe, f32, dict(tokens=7, hidden=48, inter=40, experts=5, top_k=2)),
                (moe, f16, dict(tokens=7, hidden=64, inter=32, experts=5, top_k=2)),
            ],
            "w8a8": [(case_w8a8, f32, dict(m=1, k=64, n=40)), (case_w8a8, f32, dict(m=20, k=128, n=96))],
            "pack_unpack": [(pack, bf16, kv), (pack, f32, kv)],
        }
    gqa = dict(hq=32, hkv=8, d=128, bs=16)
    if mode == "quick":
        return {
            "decode_attention": [
                (dec, f32, dict(batch=4, max_len=256, **gqa)),
                (dec, bf16, dict(batch=16, max_len=512, **gqa)),
            ],
            "prefill_attention": [
                (pre, f32, dict(q_lens=[64, 57, 1], prefixes=[0, 21, 67], **gqa)),
                (pre, bf16, dict(q_lens=[512, 512], prefixes=[0, 512], **gqa)),
            ],
            "moe_route": [(case_route, f32, dict(tokens=256, hidden=1024, experts=64, top_k=8))],
            "fused_moe": [
                (moe, f32, dict(tokens=32, hidden=256, inter=128, experts=8, top_k=2)),
                (moe, bf16, dict(tokens=64, hidden=1024, inter=384, experts=32, top_k=4)),
            ],
            "w8a8": [
                (case_w8a8, f32, dict(m=33, k=512, n=384)),
                (case_w8a8, bf16, dict(m=64, k=2048, n=2048)),
            ],
            "pack_unpack": [
                (
                    pack,
                    bf16,
                    dict(layers=8, heads=4, num_blocks=256, bs=16, d=128, n=64, head_begin=0, head_end=4),
                )
            ],
        }
    return {
        "decode_attention": [
            (dec, f32, dict(batch=16, max_len=1024, **gqa)),
            (dec, bf16, dict(batch=64, max_len=2048, **gqa)),
        ],
        "prefill_attention": [
            (pre, f32, dict(q_lens=[256, 249, 1, 128], prefixes=[0, 21, 67, 32], **gqa)),
            (pre, bf16, dict(q_lens=[1024] * 4, prefixes=[0, 1024, 512, 37], **gqa)),
        ],
        "moe_route": [(case_route, f32, dict(tokens=1024, hidden=2048, experts=128, top_k=8))],
        "fused_moe": [
            (moe, f32, dict(tokens=64, hidden=512, inter=256, experts=16, top_k=4)),
            (moe, bf16, dict(tokens=16, hidden=2048, inter=768, experts=128, top_k=8)),
            (moe, bf16, dict(tokens=1024, hidden=2048, inter=768, experts=128, top_k=8)),
        ],
        "w8a8": [
            (case_w8a8, f32, dict(m=33, k=512, n=384)),
            (case_w8a8, bf16, dict(m=16, k=4096, n=4096)),
            (case_w8a8, bf16, dict(m=512, k=4096, n=4096)),
        ],
        "pack_unpack": [
            (pack, f32, dict(layers=4, heads=4, num_blocks=64, bs=16, d=64, n=16, head_begin=1, head_end=3)),
            (
                pack,
                bf16,
                dict(layers=16, heads=8, num_blocks=1024, bs=16, d=128, n=256, head_begin=2, head_end=6),
            ),
        ],
    }


def section_triton(ctx: Ctx) -> None:
    res = ctx.result
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if ctx.device.type != "cuda" and not interpret:
        raise RuntimeError("the Triton kernels need CUDA, or TRITON_INTERPRET=1 on CPU tensors")
    import triton

    mode = "interpreter" if interpret else "quick" if ctx.quick else "full"
    timed = ctx.device.type == "cuda" and not interpret
    res |= {"device": str(ctx.device), "interpreter": interpret, "mode": mode, "triton": triton.__version__}
    if not timed:
        res["speed"] = (
            "omitted: not meaningful under TRITON_INTERPRET=1 (every program instance runs in Python)"
        )
    res["kernels"] = {}
    margin = 5.0 if interpret else 15.0
    with torch.inference_mode():
        for kernel, cases in triton_plan(mode).items():
            entries = res["kernels"][kernel] = []
            for fn, dtype, kwargs in cases:
                head = {"dtype": str(dtype).removeprefix("torch.")}
                if ctx.left() < margin:
                    entries.append(head | {"skipped": "out of time", "params": kwargs})
                    continue
                t = time.perf_counter()
                try:
                    entry = head | fn(ctx, timed, dtype, **kwargs)
                except Exception as err:
                    traceback.print_exc()
                    entry = head | {"params": kwargs, "error": error_text(err), "ok": False}
                entry["wall_s"] = round(time.perf_counter() - t, 2)
                entries.append(entry)
                log(f"triton {kernel} {head['dtype']}: {entry}")
                ctx.save()
                if ctx.device.type == "cuda":
                    torch.cuda.empty_cache()
    checked = [e for entries in res["kernels"].values() for e in entries if "skipped" not in e]
    res["ok"] = bool(checked) and all(e.get("ok") for e in checked)
    res["cases"] = {"checked": len(checked), "failed": sum(not e.get("ok") for e in checked)}


# ---------------------------------------------------------------- engine

PARITY_NEW_TOKENS = 32


def conftest_spec(name: str = "SECOND_SPEC") -> dict:
    """A checkpoint spec from tests/conftest.py, read without importing it (it needs pytest)."""
    tree = ast.parse((REPO / "tests" / "conftest.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{name} is not in tests/conftest.py")


def hidden_style_model(models_dir: Path) -> Path:
    """tests/conftest.py's second checkpoint (made as its `second_model_dir` fixture makes it), cached
    under a name that changes with the spec."""
    from kvferry.model.create import create_from_spec

    spec = conftest_spec()
    digest = hashlib.blake2b(json.dumps(spec, sort_keys=True).encode(), digest_size=4).hexdigest()
    out = models_dir / f"gpu-check-second-{digest}"
    if not (out / "config.json").is_file():
        create_from_spec(spec, out, seed=7, max_shard_bytes=1_000_000)
    return out


def parity_prompts(vocab: int) -> list[list[int]]:
    """8 prompts of mixed lengths, three sharing a 48-token (3-block) prefix (as tests/parity)."""
    gen = torch.Generator().manual_seed(3)
    out = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 17, 33, 64, 9, 40, 0, 0)]
    shared = torch.randint(3, vocab, (48,), generator=gen).tolist()
    out[0] = shared + out[0]
    out[6] = [*shared, 11, 12, 13]
    out[7] = shared + list(range(20, 40))
    return out


def kvferry_greedy(
    model_dir: Path, prompts, device: torch.device, kernels: str
) -> tuple[list[list[int]], str]:
    from kvferry.engine.engine import EngineConfig, LLMEngine
    from kvferry.engine.request import SamplingParams

    cfg = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device=device.type,
        kernels=kernels,
        max_model_len=256,
        num_kv_blocks=256,
    )
    engine = LLMEngine(cfg)
    params = SamplingParams(max_tokens=PARITY_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    done = engine.generate([{"prompt_token_ids": p} for p in prompts], params)
    backend = engine.kernel_backend
    del engine
    return [list(d.output_token_ids) for d in done], backend


def transformers_greedy(model_dir: Path, prompts, device: torch.device) -> list[list[int]]:
    """Greedy continuations (no EOS stop) of each prompt by `transformers` in float32 on `device` (as
    tests/conftest.py's transformers_greedy, on the device)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            inp = torch.tensor([ids], device=device)
            out = hf.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                max_new_tokens=PARITY_NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            refs.append(out[0, len(ids) :].tolist())
    del hf
    return refs


def parity(model_dir: Path, device: torch.device, kernels: str) -> dict:
    from kvferry.model.config import ModelConfig

    prompts = parity_prompts(ModelConfig.from_dir(model_dir).vocab_size)
    t = time.perf_counter()
    ours, backend = kvferry_greedy(model_dir, prompts, device, kernels)
    engine_s = time.perf_counter() - t
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t = time.perf_counter()
    if importlib.util.find_spec("transformers") is not None:
        reference = f"transformers ({device.type}, float32)"
        refs = transformers_greedy(model_dir, prompts, device)
    else:  # the torch path on the CPU: what CI checks against transformers (tests/parity)
        reference = "kvferry --kernels torch on cpu, float32 (transformers is not installed)"
        refs, _ = kvferry_greedy(model_dir, prompts, torch.device("cpu"), "torch")
    reference_s = time.perf_counter() - t
    diverge = [
        next((i for i, (a, b) in enumerate(zip(o, r, strict=False)) if a != b), None)
        for o, r in zip(ours, refs, strict=True)
    ]
    same = [o == r for o, r in zip(ours, refs, strict=True)]
    agree = sum(a == b for o, r in zip(ours, refs, strict=True) for a, b in zip(o, r, strict=False))
    return {
        "reference": reference,
        "kernels": backend,
        "prompts": len(prompts),
        "new_tokens": PARITY_NEW_TOKENS,
        "matching_prompts": sum(same),
        "tokens_agree": rounded(agree / sum(len(r) for r in refs)),
        "first_divergence": [d if not s else None for d, s in zip(diverge, same, strict=True)],
        "ok": all(same),
        "engine_s": round(engine_s, 2),
        "reference_s": round(reference_s, 2),
    }


def engine_perf(ctx: Ctx, kernels: str, res: dict) -> None:
    """The bench model (bf16 on CUDA) into `res`: decode step time at batch 1 and 32 against the HBM
    roofline, and prefill tokens/s."""
    from engine_throughput import decode_step_ms_at_batch_1, make_prompts

    from kvferry.engine.engine import EngineConfig, LLMEngine
    from kvferry.engine.request import SamplingParams

    dev = ctx.device
    input_len, num_prefill = (256, 8) if ctx.quick else (1024, 32)
    model_dir = bench_model_dir("bench")
    cfg = EngineConfig(
        model=str(model_dir),
        device=dev.type,
        kernels=kernels,
        max_model_len=input_len + 64,
        max_num_batched_tokens=8192,
    )
    engine = LLMEngine(cfg)
    mcfg = engine.model.cfg
    res |= {"model": "bench", "dtype": engine.dtype, "kernels": engine.kernel_backend}
    vocab = mcfg.vocab_size
    # warm-up: the kernels compile (Triton) for the prefill and decode shapes used below
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate([{"prompt_token_ids": p} for p in make_prompts(8, 32, vocab, seed=1000)], warm)
    decode_step_ms_at_batch_1(engine, steps=4)
    step_1 = decode_step_ms_at_batch_1(engine)
    decode = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
    full_batch_step_ms(engine, [(decode, p) for p in make_prompts(32, 32, vocab, seed=2000)])
    step_32 = full_batch_step_ms(engine, [(decode, p) for p in make_prompts(32, 32, vocab, seed=2001)])
    ctx.save()
    gbps = cuda_copy_gbps(dev) if dev.type == "cuda" else memcpy_gbps()
    itemsize = engine.model.lm_head.element_size()  # the weights as stored
    res["hbm_gbps" if dev.type == "cuda" else "memcpy_gbps"] = rounded(gbps)
    for batch, step in ((1, step_1), (32, step_32)):
        roof = weight_bytes_per_step(mcfg, batch, itemsize) / (gbps * 1e9) * 1e3
        res[f"decode_step_ms_at_batch_{batch}"] = rounded(step)
        res[f"roofline_ms_at_batch_{batch}"] = rounded(roof)
        res[f"roofline_fraction_at_batch_{batch}"] = rounded(roof / step, 3)
    res["weight_mb_per_step_at_batch_1"] = rounded(weight_bytes_per_step(mcfg, 1, itemsize) / 2**20)
    ctx.save()
    if ctx.left() < 20:
        res["prefill"] = "skipped: out of time"
        return
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate(
        [{"prompt_token_ids": p} for p in make_prompts(num_prefill, input_len, vocab, 3000)], once
    )
    prompts = make_prompts(num_prefill, input_len, vocab, seed=3001)  # fresh: no prefix-cache hits
    t = time.perf_counter()
    engine.generate([{"prompt_token_ids": p} for p in prompts], once)
    elapsed = time.perf_counter() - t
    res |= {"prefill_prompts": num_prefill, "prefill_input_len": input_len}
    res["prefill_tok_s"] = rounded(num_prefill * input_len / elapsed)


def section_engine(ctx: Ctx) -> None:
    if COMMON_ERROR:
        raise RuntimeError(COMMON_ERROR)
    from kvferry.model.create import resolve_model
    from kvferry.settings import load_settings

    res = ctx.result
    models_dir = load_settings().models_dir
    kernels = "auto" if ctx.device.type == "cuda" else "torch"  # auto on CUDA: the Triton kernels
    res |= {"device": str(ctx.device), "models_dir": str(models_dir)}
    checkpoints = {
        "tiny": lambda: resolve_model("tiny", models_dir),
        "hidden_style": lambda: hidden_style_model(models_dir),
    }
    res["parity"] = {}
    for name, make in checkpoints.items():
        if ctx.left() < 30:
            res["parity"][name] = "skipped: out of time"
            continue
        t = time.perf_counter()
        try:
            res["parity"][name] = parity(make(), ctx.device, kernels)
        except Exception as err:
            traceback.print_exc()
            res["parity"][name] = {"error": error_text(err)}
        res["parity"][name]["wall_s"] = round(time.perf_counter() - t, 1)
        log(f"engine parity {name}: {res['parity'][name]}")
        ctx.save()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    res["ok"] = all(isinstance(p, dict) and p.get("ok") for p in res["parity"].values())
    ctx.save()
    if ctx.left() < 40:
        res["perf"] = "skipped: out of time"
        return
    t = time.perf_counter()
    res["perf"] = {}
    try:
        engine_perf(ctx, kernels, res["perf"])  # filled in place: a killed section keeps what it saved
    except Exception as err:
        traceback.print_exc()
        res["perf"]["error"] = error_text(err)
    res["perf"]["wall_s"] = round(time.perf_counter() - t, 1)
    log(f"engine perf: {res['perf']}")


# ---------------------------------------------------------------- KV hand-off between processes

# the bench model's KV layout: [L, 2, H_kv, num_blocks, block_size, D] in bf16, 64 KiB per block
HANDOFF_LAYOUT = {"layers": 8, "heads": 4, "num_blocks": 2048, "block_size": 16, "head_dim": 32}


def _pin(t: torch.Tensor) -> bool:
    """Page-lock a shared host tensor for this process (as torch's own state-dict stager does)."""
    try:
        from torch.cuda import _pin_memory_utils

        _pin_memory_utils.pin_memory(t.data_ptr(), t.numel() * t.element_size())
        return True
    except Exception as err:
        log(f"pinning shared host memory failed ({error_text(err)}); staging through pageable memory")
        return False


def _unpin(t: torch.Tensor) -> None:
    with contextlib.suppress(Exception):
        from torch.cuda import _pin_memory_utils

        _pin_memory_utils.unpin_memory(t.data_ptr())


def handoff_peer(inbox, outbox, device_name: str) -> None:
    """The other process: holds its own paged cache; "recv" unpacks blocks from a shared buffer into it,
    "send" packs blocks from it into a shared buffer. Replies ("ok", seconds of its own work)."""
    pinned: list[torch.Tensor] = []
    try:
        from kvferry.kvpool import transfer

        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        cache, bufs = None, {}

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        while True:
            msg = inbox.get()
            op = msg[0]
            if op == "stop":
                break
            t = time.perf_counter()
            if op == "setup":  # (cache shape, dtype, {name: shared tensor})
                _, shape, dtype, shared = msg
                for t_ in pinned:
                    _unpin(t_)
                pinned = [
                    b for b in shared.values() if b.device.type == "cpu" and device.type == "cuda" and _pin(b)
                ]
                cache, bufs = torch.zeros(shape, dtype=dtype, device=device), shared
                outbox.put(("ok", len(pinned)))
                continue
            _, name, ids = msg
            view = bufs[name][: len(ids)]
            if op == "recv":  # the blocks arrive: into this process's cache (from host: the H2D copies)
                transfer.unpack_blocks(cache, ids, view)
            elif op == "send":  # the blocks leave: packed into the shared buffer (to host: D2H copies)
                transfer.pack_blocks(cache, ids, out=view)
            else:
                raise ValueError(f"unknown op {op!r}")
            sync()
            outbox.put(("ok", time.perf_counter() - t))
    except BaseException as err:
        outbox.put(("error", f"{error_text(err)}\n{traceback.format_exc()}"))
    finally:
        for t_ in pinned:
            _unpin(t_)


def await_message(ctx: Ctx, box, procs, limit: float):
    """The next message on `box`; TimeoutError after `limit` seconds (or the section's deadline), or
    once one of `procs` has died without a word."""
    limit = min(limit, ctx.left())
    end = time.time() + limit
    while True:
        try:
            return box.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                with contextlib.suppress(queue.Empty):  # its last words may still be in the pipe
                    return box.get(timeout=2.0)
                codes = ", ".join(f"{p.name}: exit {p.exitcode}" for p in dead)
                raise RuntimeError(f"a helper process died ({codes})") from None
            if time.time() > end:
                raise TimeoutError(f"no message from the helper processes in {limit:.0f} s") from None


def _reply(ctx: Ctx, outbox, peer, limit: float = 120.0):
    status, value = await_message(ctx, outbox, [peer], limit)
    if status != "ok":
        raise RuntimeError(f"peer: {value}")
    return value


def handoff_mode(ctx: Ctx, mp, mode: str, sizes: list[int], iters: int) -> dict:
    """Hand blocks to a spawned peer process and back, through `mode`'s shared buffers: "cuda_ipc"
    (CUDA tensors shared through torch.multiprocessing: the peer maps them by CUDA IPC) or
    "host_staging" (shared host memory, pinned where it can be)."""
    from kvferry.kvpool import transfer

    dev = ctx.device
    lay = HANDOFF_LAYOUT
    dtype = torch.bfloat16
    shape = (lay["layers"], 2, lay["heads"], lay["num_blocks"], lay["block_size"], lay["head_dim"])
    block_shape = shape[:3] + shape[4:]
    g = torch.Generator(device=dev).manual_seed(0)
    cache = torch.randn(shape, generator=g, device=dev).to(dtype)
    back = torch.zeros_like(cache)  # where the blocks land on their way back
    buf_device = dev if mode == "cuda_ipc" else torch.device("cpu")
    n_max = max(sizes)
    bufs = {
        name: torch.empty((n_max, *block_shape), dtype=dtype, device=buf_device)
        for name in ("to_peer", "from_peer")
    }
    pinned = []
    if buf_device.type == "cpu":
        for b in bufs.values():
            b.share_memory_()
            if dev.type == "cuda" and _pin(b):
                pinned.append(b)
    inbox, outbox = mp.Queue(), mp.Queue()
    peer = mp.Process(target=handoff_peer, args=(inbox, outbox, str(dev)), daemon=True)
    res = {"buffers": str(buf_device), "block_kib": rounded(math.prod(block_shape) * 2 / 1024), "sizes": []}
    try:
        t = time.perf_counter()
        peer.start()
        inbox.put(("setup", shape, dtype, bufs))
        peer_pinned = _reply(ctx, outbox, peer, 180.0)
        res["peer_start_s"] = round(time.perf_counter() - t, 2)
        if buf_device.type == "cpu" and dev.type == "cuda":
            res["pinned"] = {"here": len(pinned) == 2, "peer": peer_pinned == 2}
        cpu_g = torch.Generator().manual_seed(1)
        for n in sizes:
            view_to, view_from = bufs["to_peer"][:n], bufs["from_peer"][:n]
            to_ms, from_ms, peer_to_ms, peer_from_ms, equal = [], [], [], [], True
            for it in range(iters + 1):  # the first round warms up (kernel compiles, IPC mapping)
                if ctx.left() < 10:
                    raise TimeoutError("out of time")
                ids = torch.randperm(lay["num_blocks"], generator=cpu_g)[:n].tolist()
                view_from.zero_()
                ctx.sync()
                t = time.perf_counter()
                transfer.pack_blocks(cache, ids, out=view_to)  # the Triton kernel (IPC) or D2H copies (host)
                ctx.sync()
                inbox.put(("recv", "to_peer", ids))
                peer_to = _reply(ctx, outbox, peer)
                t_to = time.perf_counter() - t
                t = time.perf_counter()
                inbox.put(("send", "from_peer", ids))
                peer_from = _reply(ctx, outbox, peer)
                transfer.unpack_blocks(back, ids, view_from)
                ctx.sync()
                t_from = time.perf_counter() - t
                # what came back went through the peer's cache: the same bytes in the same blocks
                with torch_copies():
                    same = torch.equal(
                        bits(transfer.pack_blocks(back, ids)), bits(transfer.pack_blocks(cache, ids))
                    )
                equal = equal and same
                if it:
                    to_ms.append(t_to * 1e3)
                    from_ms.append(t_from * 1e3)
                    peer_to_ms.append(peer_to * 1e3)
                    peer_from_ms.append(peer_from * 1e3)
            nbytes = view_to.numel() * view_to.element_size()
            to_med, from_med = statistics.median(to_ms), statistics.median(from_ms)
            res["sizes"].append(
                {
                    "blocks": n,
                    "mb": rounded(nbytes / 2**20),
                    "to_peer_ms": rounded(to_med),
                    "from_peer_ms": rounded(from_med),
                    "to_peer_gbps": rounded(nbytes / (to_med / 1e3) / 1e9),
                    "from_peer_gbps": rounded(nbytes / (from_med / 1e3) / 1e9),
                    "peer_copy_in_ms": rounded(statistics.median(peer_to_ms)),
                    "peer_copy_out_ms": rounded(statistics.median(peer_from_ms)),
                    "bytes_equal": equal,
                    "iters": iters,
                }
            )
            ctx.save()
        res["ok"] = all(s["bytes_equal"] for s in res["sizes"])
        inbox.put(("stop",))
        peer.join(timeout=30)
    finally:
        if peer.is_alive():
            peer.kill()
            peer.join(timeout=10)
        for b in pinned:
            _unpin(b)
    return res


def section_handoff(ctx: Ctx) -> None:
    import torch.multiprocessing as tmp

    mp = tmp.get_context("spawn")  # CUDA in a child needs spawn (a forked child cannot use CUDA)
    res = ctx.result
    sizes = [64] if ctx.quick else [64, 1024]  # 4 MB and 64 MB of bench-model blocks
    res |= {"device": str(ctx.device), "layout": HANDOFF_LAYOUT | {"dtype": "bfloat16"}}
    res["timing"] = "wall time of a hand-off: pack + signal + the peer's copy in (and the reverse), median"
    modes = ["cuda_ipc", "host_staging"] if ctx.device.type == "cuda" else ["host_staging"]
    for mode in modes:
        if ctx.left() < 20:
            res[mode] = "skipped: out of time"
            continue
        t = time.perf_counter()
        try:
            res[mode] = handoff_mode(ctx, mp, mode, sizes, iters=3 if ctx.quick else 5)
        except Exception as err:
            traceback.print_exc()
            res[mode] = {"error": error_text(err)}
        res[mode]["wall_s"] = round(time.perf_counter() - t, 1)
        log(f"handoff {mode}: {res[mode]}")
        ctx.save()
    res["ok"] = all(isinstance(res[m], dict) and res[m].get("ok") for m in modes)


# ---------------------------------------------------------------- NCCL between two GPUs


def nccl_rank(
    rank: int, port: int, backend: str, device_type: str, sizes: list[int], iters: int, outbox
) -> None:
    """One of two ranks: rank 0 sends KV blocks, rank 1 unpacks them into its cache, packs them again and
    sends them back; rank 0 checks the bytes and reports the round-trip times."""
    import torch.distributed as dist

    try:
        from kvferry.kvpool import transfer

        if device_type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            device = torch.device("cpu")

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=90),
        )
        lay = HANDOFF_LAYOUT
        shape = (lay["layers"], 2, lay["heads"], lay["num_blocks"], lay["block_size"], lay["head_dim"])
        g = torch.Generator(device=device).manual_seed(rank)
        cache = torch.randn(shape, generator=g, device=device).to(torch.bfloat16)
        if rank == 1:
            cache.zero_()
        cpu_g = torch.Generator().manual_seed(5)  # the same block ids on both ranks
        results = []
        for n in sizes:
            buf = torch.empty((n, *shape[:3], *shape[4:]), dtype=torch.bfloat16, device=device)
            back = torch.empty_like(buf)
            rtt, equal = [], True
            for it in range(iters + 1):
                ids = torch.randperm(lay["num_blocks"], generator=cpu_g)[:n].tolist()
                if rank == 0:
                    transfer.pack_blocks(cache, ids, out=buf)
                    back.zero_()
                    sync()
                    t = time.perf_counter()
                    dist.send(buf, 1)
                    dist.recv(back, 1)
                    sync()
                    if it:
                        rtt.append((time.perf_counter() - t) * 1e3)
                    equal = equal and torch.equal(bits(back), bits(buf))
                else:
                    dist.recv(buf, 0)
                    transfer.unpack_blocks(cache, ids, buf)
                    transfer.pack_blocks(cache, ids, out=back)
                    dist.send(back, 0)
                    sync()
            if rank == 0:
                nbytes = buf.numel() * buf.element_size()
                med = statistics.median(rtt)
                results.append(
                    {
                        "blocks": n,
                        "mb": rounded(nbytes / 2**20),
                        "round_trip_ms": rounded(med),
                        "gbps_each_way": rounded(2 * nbytes / (med / 1e3) / 1e9),
                        "bytes_equal": equal,
                    }
                )
        dist.destroy_process_group()
        outbox.put((rank, "ok", results))
    except BaseException as err:
        outbox.put((rank, "error", f"{error_text(err)}\n{traceback.format_exc()}"))


def section_nccl(ctx: Ctx) -> None:
    import torch.multiprocessing as tmp

    from kvferry.proc import free_port

    mp = tmp.get_context("spawn")
    backend = "nccl" if ctx.device.type == "cuda" else "gloo"  # gloo: the CPU dry run of the same code
    sizes = [64] if ctx.quick else [64, 1024]
    res = ctx.result
    res |= {"backend": backend, "devices": "cuda:0 <-> cuda:1" if backend == "nccl" else "cpu <-> cpu"}
    outbox = mp.Queue()
    port = free_port("127.0.0.1")
    procs = [
        mp.Process(target=nccl_rank, args=(r, port, backend, ctx.device.type, sizes, 5, outbox), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        replies = {}
        while len(replies) < 2:
            # a rank that finished has exited: wait on the ones still to answer
            waiting = [p for r, p in enumerate(procs) if r not in replies]
            rank, status, value = await_message(ctx, outbox, waiting, ctx.left())
            replies[rank] = (status, value)
        errors = {r: v for r, (s, v) in replies.items() if s != "ok"}
        if errors:
            raise RuntimeError("; ".join(f"rank {r}: {v}" for r, v in sorted(errors.items())))
        res["sizes"] = replies[0][1]
        res["ok"] = all(s["bytes_equal"] for s in res["sizes"])
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


# ---------------------------------------------------------------- the report


def _cell(v) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _table(rows: list[list], header: list[str]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]


def _section_lines(name: str, sec) -> list[str]:
    lines = [f"## {name}", ""]
    if isinstance(sec, str):
        return [*lines, sec, ""]
    if "error" in sec:
        lines += [f"**error**: `{sec['error']}`", ""]
    if name == "triton" and "kernels" in sec:
        if "speed" in sec:
            lines += [f"speed {sec['speed']}", ""]
        rows = []
        for kernel, entries in sec["kernels"].items():
            for e in entries:
                err = "bit-exact" if e.get("bit_exact") else e.get("max_abs_err")
                tol = (
                    f"{e['atol']:g}/{e['rtol']:g}" if "atol" in e else ("bits" if "bit_exact" in e else None)
                )
                note = e.get("error") or e.get("skipped") or e.get("shape")
                row = [kernel, e.get("dtype"), e.get("ok"), err, tol, e.get("triton_ms"), e.get("torch_ms")]
                rows.append([*row, e.get("speedup"), note])
        header = [
            "kernel",
            "dtype",
            "ok",
            "max abs err",
            "atol/rtol",
            "triton ms",
            "torch ms",
            "speedup",
            "case",
        ]
        lines += [*_table(rows, header), ""]
    elif name == "engine":
        parity = sec.get("parity", {})
        rows = []
        for ckpt, p in parity.items():
            if isinstance(p, str) or "error" in p:
                rows.append([ckpt, None, None, None, p if isinstance(p, str) else p["error"]])
            else:
                rows.append(
                    [
                        ckpt,
                        p["ok"],
                        f"{p['matching_prompts']}/{p['prompts']}",
                        p["tokens_agree"],
                        p["reference"],
                    ]
                )
        lines += [*_table(rows, ["checkpoint", "ok", "prompts equal", "tokens agree", "reference"]), ""]
        perf = sec.get("perf")
        if isinstance(perf, dict):
            lines += [f"- {k}: {v}" for k, v in perf.items()] + [""]
        elif perf:
            lines += [f"- perf: {perf}", ""]
    elif name == "handoff":
        rows = []
        for mode in ("cuda_ipc", "host_staging"):
            m = sec.get(mode)
            if isinstance(m, dict) and "sizes" in m:
                for s in m["sizes"]:
                    row = [mode, s["mb"], s["bytes_equal"], s["to_peer_ms"], s["to_peer_gbps"]]
                    rows.append([*row, s["from_peer_ms"], s["from_peer_gbps"]])
            if isinstance(m, dict) and "error" in m:
                rows.append([mode, None, None, None, None, None, m["error"]])
            elif isinstance(m, str):
                rows.append([mode, None, None, None, None, None, m])
        header = ["mode", "MB", "bytes equal", "to peer ms", "GB/s", "from peer ms", "GB/s"]
        lines += [*_table(rows, header), ""]
    elif name == "nccl" and "sizes" in sec:
        rows = [[s["mb"], s["bytes_equal"], s["round_trip_ms"], s["gbps_each_way"]] for s in sec["sizes"]]
        lines += [*_table(rows, ["MB", "bytes equal", "round trip ms", "GB/s each way"]), ""]
    lines += [
        "<details><summary>raw</summary>",
        "",
        "```json",
        json.dumps(sec, indent=1),
        "```",
        "</details>",
        "",
    ]
    return lines


def write_report(path: Path, result: dict) -> None:
    env = result["env"]
    lines = ["# gpu_check report", ""]
    when = datetime.now(UTC).isoformat(timespec="seconds")
    lines += [f"- {when}; wall {result['wall_s']} s of budget {result['budget_s']} s"]
    where = env.get("gpu") or "no CUDA device"
    lines += [
        f"- {where}"
        + (f" (capability {env['capability']}, {env['gpu_count']} GPU(s))" if "gpu" in env else "")
    ]
    lines += [
        f"- torch {env['torch']} (CUDA {env['torch_cuda']}), triton {env['triton']}, python {env['python']}"
    ]
    cpu = f"{env.get('cpu_model')} x{env.get('cpu_count')}"
    lines += [f"- CPU: {cpu}; flags {env.get('cpu_flags')}; AMX: {env.get('amx')}"]
    lines += [f"- section wall times (s): {result['section_wall_s']}", ""]
    for name in SECTIONS:
        try:
            lines += _section_lines(name, result[name])
        except Exception as err:  # the report never loses the run: fall back to the raw JSON
            lines += [f"## {name}", "", f"(report rendering failed: {error_text(err)})", "```json"]
            lines += [json.dumps(result[name], indent=1), "```", ""]
    lines += ["## environment", "", "```json", json.dumps(env, indent=1), "```", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


# ---------------------------------------------------------------- main


def skip_reason(name: str, args, cuda: bool) -> str | None:
    on_device = args.device == "cuda"
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        if not on_device and os.environ.get("TRITON_INTERPRET") != "1":
            return "no CUDA (TRITON_INTERPRET=1 runs the parity checks on CPU under Triton's interpreter)"
        return None
    if name in ("engine", "handoff"):
        return None if on_device or args.device_forced else "no CUDA"
    if name == "nccl":
        found = torch.cuda.device_count() if cuda else 0
        if args.device_forced and not on_device:
            return None  # the CPU dry run: gloo
        return None if on_device and found >= 2 else f"needs 2 GPUs (found {found})"
    raise ValueError(name)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=420.0, help="the whole run's time budget (seconds)")
    ap.add_argument("--report", type=Path, default=None, help="markdown report path")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list of: " + ", ".join(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="small sizes")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="default: cuda where there is one; cpu: a dry run of every section on the CPU",
    )
    # a section's own process (run_section)
    ap.add_argument("--child", choices=SECTIONS, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.device_forced = args.device is not None
    return args


def main() -> int:
    args = parse_args()
    if args.child:
        return run_child(args)
    start = time.monotonic()
    cuda = torch.cuda.is_available()
    if not cuda:
        print(NO_CUDA_LINE, flush=True)
    if args.device is None:
        args.device = "cuda" if cuda else "cpu"
    elif args.device == "cuda" and not cuda:
        args.device, args.device_forced = "cpu", False  # nothing to force: the no-CUDA run
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown --sections {unknown}; choose from {', '.join(SECTIONS)}")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path.cwd()
    report = args.report or out_dir / "gpu_check_report.md"
    if args.out is None and os.environ.get("OUT"):
        args.out = out_dir / "gpu_check.json"

    result: dict = {"cuda": cuda, "device": args.device, "quick": args.quick, "budget_s": args.budget_s}
    t = time.monotonic()
    try:
        result["env"] = environment(cuda)
    except Exception as err:
        traceback.print_exc()
        result["env"] = {"error": error_text(err)}
    walls = {"env": round(time.monotonic() - t, 1)}
    to_run = []
    for name in SECTIONS:
        why = "not in --sections" if name not in wanted else skip_reason(name, args, cuda)
        if why:
            result[name] = f"skipped: {why}"
        else:
            to_run.append(name)
    scale = args.budget_s / sum(BUDGETS.values())
    for i, name in enumerate(to_run):
        left = args.budget_s - (time.monotonic() - start)
        later = sum(BUDGETS[n] * scale for n in to_run[i + 1 :])
        limit = min(left, max(BUDGETS[name] * scale, left - later))
        if limit < MIN_SECTION_S:
            result[name] = f"skipped: out of time ({left:.0f} s of the {args.budget_s:.0f} s budget left)"
            continue
        result[name] = run_section(name, limit, args)
        walls[name] = result[name]["wall_s"]
    result["section_wall_s"] = walls
    result["wall_s"] = round(time.monotonic() - start, 1)
    ran = [result[n] for n in to_run if isinstance(result[n], dict)]
    result["ok"] = all(r.get("ok") and "error" not in r for r in ran) if ran else None
    result = clean(result)
    try:
        write_report(report, result)
        result["report"] = str(report)
    except Exception as err:
        traceback.print_exc()
        result["report"] = f"not written: {error_text(err)}"
    if COMMON_ERROR:  # common.print_result is not there
        line = json.dumps(result)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(line + "\n")
        print(line, flush=True)
    else:
        print_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
