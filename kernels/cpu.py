"""kvferry's C++ CPU kernels (`cpu/*.cpp`): packed skinny GEMM, fused norms, RoPE + KV store, paged decode
and prefill attention and the MoE experts, each one call per layer instead of a dozen torch ops.

The sources are compiled on first use with the machine's C++ compiler (torch.utils.cpp_extension; about
20 s, once) into `<KVFERRY_CACHE_DIR>/kernels/`, keyed by the sources, torch version and compiler flags, and
registered as `torch.ops.kvferry_cpu.*`. They need float32 activations and AVX2 + FMA; `load()` returns
False where they cannot serve (another CPU, no compiler), and callers keep the plain torch path. On CPUs
with AVX512-BF16 the build adds a GEMM over bf16 weights packed in k pairs (`pack_weight_bf16_pairs`)
that rounds the activations to bf16 and multiplies with vdpbf16ps: what `--dtype bfloat16` runs there.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from pathlib import Path

import torch

from kvferry.settings import load_settings

SOURCE_DIR = Path(__file__).parent / "cpu"
SOURCES = (SOURCE_DIR / "kvferry_cpu.cpp", SOURCE_DIR / "prefill_attention.cpp")
HEADERS = (SOURCE_DIR / "vec_math.h", SOURCE_DIR / "int8_gemm.h")
# -fopenmp: at::parallel_for is header code that runs serially without it; the libgomp.so.1 it binds to at
# load time is the one torch already loaded (same soname), so there is one OpenMP thread pool
BASE_FLAGS = ["-O3", "-mavx2", "-mfma", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
# CPUs with AVX512-BF16 (Zen 4+, Cooper Lake, Sapphire Rapids+) also get the bf16 dot-product GEMM
BF16_DOT_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-DKVFERRY_AVX512BF16"]
# CPUs with AVX512-VNNI (Cascade Lake+, Zen 4+) run `--quantization int8` with vpdpbusd; others with AVX2
INT8_DOT_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-DKVFERRY_AVX512VNNI"]
# KVFERRY_CPU_ISA=avx2 makes kvferry see this CPU as AVX2-only (no AVX-512 or AMX flags): the kernels' AVX2
# build, float32 by default. With ATen's ATEN_CPU_CAPABILITY=avx2 it is how the benchmarks stand in for an
# AVX2-only host on an AVX-512 one.
ISA_ENV = "KVFERRY_CPU_ISA"
_lock = threading.Lock()
_state: dict[str, bool] = {}
log = logging.getLogger(__name__)


def cpu_flags() -> frozenset[str]:
    """The feature flags /proc/cpuinfo lists for this CPU (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    found = frozenset(line.partition(":")[2].split())
    isa = os.environ.get(ISA_ENV, "").lower()
    if isa == "avx2":
        return frozenset(f for f in found if not f.startswith(("avx512", "amx", "avx_vnni")))
    if isa not in ("", "native"):
        raise ValueError(f"{ISA_ENV}={isa!r}: use avx2 or native")
    return found


def has_avx512_bf16() -> bool:
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()


def has_avx512_vnni() -> bool:
    return {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags()


def flags() -> list[str]:
    extra = (BF16_DOT_FLAGS if has_avx512_bf16() else []) + (INT8_DOT_FLAGS if has_avx512_vnni() else [])
    return BASE_FLAGS + list(dict.fromkeys(extra))


def supported() -> bool:
    """The CPU can run the kernels (AVX2 + FMA; ATen reports AVX2 or better)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "AVX512_BF16", "AMX")


def build_name() -> str:
    code = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    digest = hashlib.sha256(code + torch.__version__.encode() + " ".join(flags()).encode())
    return f"kvferry_cpu_{digest.hexdigest()[:16]}"


def load() -> bool:
    """Build (first time on this machine) and register the kernels; False if they cannot serve here."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = supported() and _build()
        return _state["ok"]


def _build() -> bool:
    from torch.utils import cpp_extension

    name = build_name()
    build_dir = load_settings().cache_dir / "kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / f"{name}.so").exists():
        print(f"kvferry: building the CPU kernels in {build_dir} (first start only, ~20 s)", file=sys.stderr)
    try:
        cpp_extension.load(
            name,
            [str(path) for path in SOURCES],
            extra_cflags=flags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as exc:  # no compiler, or it failed: torch ops serve
        log.warning("kvferry CPU kernels unavailable, using torch ops: %s", str(exc).splitlines()[0])
        return False
    return True


def ops():
    """The registered kernels, `torch.ops.kvferry_cpu` (after `load()` returned True)."""
    return torch.ops.kvferry_cpu


def bf16_dot() -> bool:
    """The loaded kernels multiply bf16 weights with bf16-rounded activations (the AVX512-BF16 build)."""
    return load() and ops().has_bf16_dot()


def int8_dot() -> bool:
    """The loaded kernels' int8 GEMM uses vpdpbusd (the AVX512-VNNI build); False: its AVX2 loop."""
    return load() and ops().has_int8_dot()


def int8_act_qmax() -> int:
    """The int8 activation range [-q, q] of this host's kernels, from its flags (nothing is built): 127
    with vpdpbusd (AVX512-VNNI), 63 in the AVX2 loop (7-bit activations, so vpmaddubsw's 16-bit pair sums
    cannot saturate; see `cpu/int8_gemm.h`), 127 where the kernels cannot run. The torch path on a CPU
    takes it too (`quant.act_qmax`), and the KV fingerprint records it where it is not 127."""
    if not supported():
        return 127
    return 127 if has_avx512_vnni() else 63


def isa() -> str:
    """The instruction sets the kernels were built for, for logs and benchmark lines."""
    return "+".join(
        ["avx2"]
        + (["avx512_bf16"] if has_avx512_bf16() else [])
        + (["avx512_vnni"] if has_avx512_vnni() else [])
    )
