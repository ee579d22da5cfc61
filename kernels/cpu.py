"""kvferry's C++ CPU kernels (`cpu/*.cpp`): packed skinny GEMM, fused norms, RoPE + KV store, paged decode
and prefill attention and the MoE experts, each one call per layer instead of a dozen torch ops.

The sources are compiled on first use with the machine's C++ compiler (torch.utils.cpp_extension; about
20 s, once) into `<KVFERRY_CACHE_DIR>/kernels/`, keyed by the sources, torch version and compiler flags, and
registered as `torch.ops.kvferry_cpu.*`. They need float32 activations and AVX2 + FMA; `load()` returns
False where they cannot serve (another CPU, no compiler), and callers keep the plain torch path. On CPUs
with AVX512-BF16 the build adds a GEMM over bf16 weights packed in k pairs (`pack_weight_bf16_pairs`)
that rounds the activations to bf16 and multiplies with vdpbf16ps: what `--dtype bfloat16` runs there.

On CPUs with AMX (amx_bf16, amx_int8, amx_tile) the bf16 and int8 GEMMs (every one: `AMX_MIN_ROWS` = 1),
and a bf16 model's prefill attention products (QK^T and PV), run through oneDNN's
brgemm microkernel on AMX tiles instead (`cpu/brgemm.h`): the same packed weights, blocks and threads, so
nothing is packed twice and the AVX-512 loops stay the fallback. `load()` turns that path on only where
oneDNN can pack for AMX and a self-check passes (`amx_self_check`: bf16 within float32 rounding of the
AVX-512 loop, int8 bit for bit); `amx()` says whether it serves. `KVFERRY_CPU_ISA=avx512` hides AMX.
"""

from __future__ import annotations

import contextlib
import fcntl
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
HEADERS = (SOURCE_DIR / "vec_math.h", SOURCE_DIR / "int8_gemm.h", SOURCE_DIR / "brgemm.h")
# -fopenmp: at::parallel_for is header code that runs serially without it; the libgomp.so.1 it binds to at
# load time is the one torch already loaded (same soname), so there is one OpenMP thread pool
BASE_FLAGS = ["-O3", "-mavx2", "-mfma", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
# CPUs with AVX512-BF16 (Zen 4+, Cooper Lake, Sapphire Rapids+) also get the bf16 dot-product GEMM
BF16_DOT_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-DKVFERRY_AVX512BF16"]
# CPUs with AVX512-VNNI (Cascade Lake+, Zen 4+) run `--quantization int8` with vpdpbusd; others with AVX2
INT8_DOT_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-DKVFERRY_AVX512VNNI"]
# KVFERRY_CPU_ISA=avx2 makes kvferry see this CPU as AVX2-only (no AVX-512 or AMX flags): the kernels' AVX2
# build, float32 by default. With ATen's ATEN_CPU_CAPABILITY=avx2 it is how the benchmarks stand in for an
# AVX2-only host on an AVX-512 one. KVFERRY_CPU_ISA=avx512 hides AMX only: an AMX Xeon runs the AVX-512
# loops (A/B timing, or a way around a misbehaving AMX path). native (or unset): the CPU as it is.
ISA_ENV = "KVFERRY_CPU_ISA"
# brgemm: the AMX path's code on a CPU without AMX (oneDNN's AVX-512 brgemm microkernel): how the path's
# blocking, layouts and numerics are tested end to end (whole clusters, parity) on AVX-512 hosts
ISA_CHOICES = ("native", "avx512", "avx2", "brgemm")
AMX_FLAGS = frozenset({"amx_bf16", "amx_int8", "amx_tile"})
# GEMMs of this many rows or more take the AMX path: every GEMM, so that a row's result never depends on
# the rows beside it (a prefill chunk's row equals the same row decoded alone, as on the AVX-512 loops:
# one path, one order of the k sums per row, whatever the batch)
AMX_MIN_ROWS = 1
_lock = threading.Lock()
_state: dict[str, bool] = {}
log = logging.getLogger(__name__)


def _cpuinfo_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_flags() -> frozenset[str]:
    """The feature flags /proc/cpuinfo lists for this CPU (empty where it cannot be read), less what
    KVFERRY_CPU_ISA hides."""
    found = _cpuinfo_flags()
    isa = os.environ.get(ISA_ENV, "").lower()
    if isa == "avx2":
        return frozenset(f for f in found if not f.startswith(("avx512", "amx", "avx_vnni")))
    if isa == "avx512":
        return frozenset(f for f in found if not f.startswith("amx"))
    if isa not in ("", "native", "brgemm"):
        raise ValueError(f"{ISA_ENV}={isa!r}: use one of {', '.join(ISA_CHOICES)}")
    return found


def has_avx512_bf16() -> bool:
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()


def has_avx512_vnni() -> bool:
    return {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags()


def has_amx() -> bool:
    """The CPU has AMX tiles for bf16 and int8 (Sapphire Rapids and later), as KVFERRY_CPU_ISA lets it show.
    Whether the kernels use them: `amx()`."""
    return cpu_flags() >= AMX_FLAGS and has_avx512_bf16() and has_avx512_vnni()


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
    """Build (first time on this machine) and register the kernels; False if they cannot serve here. Where
    the CPU has AMX, also choose the AMX path (`select_amx`)."""
    with _lock:
        if "ok" not in _state:
            _state["ok"] = supported() and _build()
            _state["amx"] = _state["ok"] and _select_amx_or_not()
        return _state["ok"]


def _select_amx_or_not() -> bool:
    try:
        return select_amx()
    except Exception as exc:  # whatever goes wrong choosing AMX, the loops serve (the path stays off)
        log.warning("kvferry CPU kernels: AMX not used: %s: %s", type(exc).__name__, exc)
        return False


def _build() -> bool:
    from torch.utils import cpp_extension

    name = build_name()
    build_dir = load_settings().cache_dir / "kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(build_dir):
            if not (build_dir / f"{name}.so").exists():
                print(
                    f"kvferry: building the CPU kernels in {build_dir} (first start only, ~20 s)",
                    file=sys.stderr,
                )
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


# torch's own guard of a build directory: a file (`lock`) created by the builder and removed when it is done
TORCH_BATON = "lock"


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold the build directory for this process's build (or load) of the kernels. torch guards a build
    with a plain file that the builder deletes when done; a builder killed mid-build (a worker stopped at
    start-up, a CI run cut off) leaves it behind, and every later start would wait on it forever. An
    flock is released by the kernel when its holder dies however it dies, so under it any baton left is
    a dead builder's: remove it, then build or load as torch does."""
    with open(build_dir / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            baton = build_dir / TORCH_BATON
            if baton.exists():
                log.warning("kvferry CPU kernels: removing %s, left by a build that did not finish", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


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
    """The instruction sets the kernels were built for, and amx_bf16 + amx_int8 where the AMX path serves
    (before `load()`: where the flags say it will), for logs and benchmark lines."""
    amx_path = _state.get("amx", False) if "ok" in _state else has_amx()
    return "+".join(
        ["avx2"]
        + (["avx512_bf16"] if has_avx512_bf16() else [])
        + (["avx512_vnni"] if has_avx512_vnni() else [])
        + (["amx_bf16", "amx_int8"] if amx_path and has_amx() else ["brgemm"] if amx_path else [])
    )


def amx() -> bool:
    """The loaded kernels run their bf16 and int8 GEMMs of `AMX_MIN_ROWS` rows or more, and the prefill
    attention's products where the caller asks for bf16 (`paged_prefill_attention(..., bf16=True)`), on
    AMX tiles (oneDNN's brgemm microkernel; `cpu/brgemm.h`)."""
    return load() and _state.get("amx", False)


def select_amx() -> bool:
    """Turn the AMX path on where the CPU shows AMX (`has_amx`), oneDNN can pack for it and the self-check
    passes; otherwise leave it off (a failed check is logged, and the AVX-512 loops serve)."""
    stand_in = os.environ.get(ISA_ENV, "").lower() == "brgemm" and has_avx512_bf16() and has_avx512_vnni()
    if not has_amx() and not stand_in:
        return False
    ops().set_brgemm_min_rows(0)
    # Linux hands out AMX tile state on request (arch_prctl); oneDNN asks too, this makes it explicit
    init = getattr(torch.cpu, "_init_amx", None)
    if init is not None:
        init()
    if not stand_in and not ops().amx_could_pack():
        log.info("kvferry CPU kernels: the CPU lists AMX but oneDNN cannot use it here; AVX-512 loops serve")
        return False
    try:
        problem = amx_self_check(layout=not stand_in)
    except Exception as exc:  # anything the microkernel raises: keep the loops that work
        problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if problem:
        log.warning("kvferry CPU kernels: AMX self-check failed (%s); the AVX-512 loops serve", problem)
        ops().set_brgemm_min_rows(0)
        return False
    ops().set_brgemm_min_rows(AMX_MIN_ROWS)
    log.info("kvferry CPU kernels: AMX serves bf16 / int8 GEMMs of %d+ rows (oneDNN brgemm)", AMX_MIN_ROWS)
    return True


# (M, K, N): row tails, a partial last column block, K not a multiple of the tiles' 32, full 64-row calls
SELF_CHECK_SHAPES = ((9, 64, 16), (33, 136, 40), (70, 256, 100), (130, 128, 24))


def amx_self_check(layout: bool = True) -> str | None:
    """Run a few shapes through the brgemm path and through the AVX-512 loops on the same packed weights:
    None if they agree (bf16: within float32 rounding; int8: bit for bit; the bf16 prefill attention within
    bf16 rounding of the float32 kernel), else what differs. `layout`: also compare the packed layouts with
    oneDNN's own packing (where oneDNN can pack: AMX hosts). Leaves the brgemm setting as it found it."""
    k = ops()
    if layout:
        status = k.brgemm_layout_check()
        if 0 in status:  # oneDNN packed the block differently (-1: it could not pack: not decisive)
            return f"packed layouts differ from oneDNN's (bf16, int8: {status})"
    gen = torch.Generator().manual_seed(43)
    before = k.set_brgemm_min_rows(0)
    try:
        for m, kk, n in SELF_CHECK_SHAPES:
            x, w = torch.randn(m, kk, generator=gen), torch.randn(kk, n, generator=gen)
            q = torch.randint(-127, 128, (kk, n), generator=gen, dtype=torch.int8)
            for name, packed in (
                ("bf16", k.pack_weight_bf16_pairs(w)),
                ("int8", k.pack_weight_int8(q, torch.rand(n, generator=gen) / 1000)),
            ):
                k.set_brgemm_min_rows(0)
                loops = k.packed_linear(x, packed, n)
                k.set_brgemm_min_rows(1)
                tiles = k.packed_linear(x, packed, n)
                if name == "int8" and not torch.equal(tiles, loops):
                    return f"int8 {m}x{kk}x{n}: not bit for bit the VNNI loop"
                if name == "bf16" and not torch.allclose(tiles, loops, rtol=1e-4, atol=1e-4):
                    err = (tiles - loops).abs().max().item()
                    return f"bf16 {m}x{kk}x{n}: max difference {err:.3g} from the AVX-512 loop"
        for d in (32, 64, 128):  # head dims the kernel takes: one PV chunk, two (128)
            hq, hkv, bs, context, q_len = 8, 2, 16, 150, 70
            k_cache, v_cache = torch.randn(2, hkv, 12, bs, d, generator=gen)
            table, q = torch.randperm(12, generator=gen)[:10], torch.randn(q_len, hq, d, generator=gen)
            k.set_brgemm_min_rows(0)
            loops = k.paged_prefill_attention(q, k_cache, v_cache, table, context, d**-0.5, True)
            k.set_brgemm_min_rows(1)
            tiles = k.paged_prefill_attention(q, k_cache, v_cache, table, context, d**-0.5, True)
            if not torch.allclose(tiles, loops, rtol=0.02, atol=0.02):
                err = (tiles - loops).abs().max().item()
                return (
                    f"bf16 prefill attention (head dim {d}): max difference {err:.3g} from the float32 kernel"
                )
    finally:
        k.set_brgemm_min_rows(before)
    return None
