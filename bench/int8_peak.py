"""The ceiling an int8 GEMM can reach over the default dtype's, per instruction set, on this CPU:
register-only loops of each inner-loop instruction sequence the C++ kernels use, one core, same run.

- AVX2: float32 FMA (`vfmadd231ps`, 8 multiply-adds) against the int8 loop of `kernels/cpu/int8_gemm.h`
  (`vpmaddubsw` on unsigned 7-bit activations x signed weights, `vpmaddwd` by ones, `vpaddd`: 32
  multiply-adds) and the 8-bit signed loop it replaced (`vpabsb` and `vpsignb` first, so that s8 x s8 is
  exact: `signed_int8`);
- AVX-512 (where the CPU has AVX512-BF16 and AVX512-VNNI): bf16 `vdpbf16ps` (32 multiply-adds) against
  `vpdpbusd` (64).

A prefill's int8 speed-up over the default dtype cannot exceed its GEMM loops' ratio (the rest of the step,
attention, norms, routing, is the same in both), so the line bounds `bench/quantization.py`'s
`prefill_speedup` on each ISA.

    python bench/int8_peak.py [--seconds 0.5]

Last line: one JSON object, GMAC/s of each loop and the int8 / default ratios.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_result, reported_cpu_flags

from kvferry.kernels.cpu import has_avx512_bf16, has_avx512_vnni
from kvferry.settings import load_settings

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <chrono>

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
volatile int sink;

// multiply-adds a second of loop `fn` (8 independent chains, `iters` iterations at a time) runs
template <typename F>
double rate(F fn, double macs_per_iter, double budget) {
  long iters = 1 << 16, done = 0;
  fn(iters);  // warm-up
  const auto t0 = std::chrono::steady_clock::now();
  while (seconds_since(t0) < budget) {
    fn(iters);
    done += iters;
  }
  return done * macs_per_iter / seconds_since(t0);
}
}  // namespace

double f32_fma(double budget) {
  return rate([](long n) {
    __m256 f[8]; for (int i = 0; i < 8; ++i) f[i] = _mm256_set1_ps(i);
    __m256 a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.9999f);
    for (long i = 0; i < n; ++i) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) f[j] = _mm256_fmadd_ps(f[j], a, b);
      __asm__ volatile("" : "+x"(a));
    }
    for (int i = 0; i < 8; ++i) sink = (int)_mm256_cvtss_f32(f[i]);
  }, 8 * 8, budget);
}

double i8_avx2(double budget, bool unsigned_activations) {
  return rate([unsigned_activations](long n) {
    __m256i acc[8], w[8];
    for (int i = 0; i < 8; ++i) { acc[i] = _mm256_set1_epi32(i); w[i] = _mm256_set1_epi8(i - 3); }
    __m256i x = _mm256_set1_epi32(0x05fb07f9);
    const __m256i ones = _mm256_set1_epi16(1);
    if (unsigned_activations) {
      for (long i = 0; i < n; ++i) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
          acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(x, w[j]), ones));
        __asm__ volatile("" : "+x"(x));
      }
    } else {
      for (long i = 0; i < n; ++i) {
        const __m256i ax = _mm256_abs_epi8(x);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j)
          acc[j] = _mm256_add_epi32(
              acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w[j], x)), ones));
        __asm__ volatile("" : "+x"(x));
      }
    }
    for (int i = 0; i < 8; ++i) sink = _mm256_extract_epi32(acc[i], 0);
  }, 8 * 32, budget);
}

#ifdef KVFERRY_AVX512
double bf16_dot(double budget) {
  return rate([](long n) {
    __m512 f[8]; for (int i = 0; i < 8; ++i) f[i] = _mm512_set1_ps(i);
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f81);
    for (long i = 0; i < n; ++i) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) f[j] = _mm512_dpbf16_ps(f[j], a, b);
      __asm__ volatile("" : "+v"(a));
    }
    for (int i = 0; i < 8; ++i) sink = (int)_mm512_reduce_add_ps(f[i]);
  }, 8 * 32, budget);
}

double i8_vnni(double budget) {
  return rate([](long n) {
    __m512i acc[8]; for (int i = 0; i < 8; ++i) acc[i] = _mm512_set1_epi32(i);
    __m512i a = _mm512_set1_epi32(0x01020304), b = _mm512_set1_epi32(0x05fb07f9);
    for (long i = 0; i < n; ++i) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
      __asm__ volatile("" : "+v"(a));
    }
    for (int i = 0; i < 8; ++i) sink = _mm512_reduce_add_epi32(acc[i]);
  }, 8 * 64, budget);
}
#endif
"""

BINDINGS = """
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("f32_fma", &f32_fma);
  m.def("i8_avx2", &i8_avx2);
#ifdef KVFERRY_AVX512
  m.def("bf16_dot", &bf16_dot);
  m.def("i8_vnni", &i8_vnni);
#endif
}
"""


def build(avx512: bool):
    flags = ["-O2", "-mavx2", "-mfma"]
    if avx512:
        flags += ["-mavx512f", "-mavx512bw", "-mavx512bf16", "-mavx512vnni", "-DKVFERRY_AVX512"]
    directory = load_settings().cache_dir / "kernels" / ("int8_peak_avx512" if avx512 else "int8_peak_avx2")
    directory.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load_inline(
        "kvferry_int8_peak" + ("_avx512" if avx512 else ""),
        SOURCE + BINDINGS,
        extra_cflags=flags,
        build_directory=str(directory),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=0.5, help="time per loop (best of 3 rounds)")
    args = ap.parse_args()
    avx512 = has_avx512_bf16() and has_avx512_vnni()
    ext = build(avx512)
    loops = {"f32_fma": lambda s: ext.f32_fma(s), "i8_avx2": lambda s: ext.i8_avx2(s, True)}
    loops["signed_i8_avx2"] = lambda s: ext.i8_avx2(s, False)
    if avx512:
        loops |= {"bf16_dot": ext.bf16_dot, "i8_vnni": ext.i8_vnni}
    torch.set_num_threads(1)
    gmacs = {name: round(max(fn(args.seconds) for _ in range(3)) / 1e9, 1) for name, fn in loops.items()}
    result = {
        "bench": "int8_peak",
        "cpu_flags": reported_cpu_flags(),
        "gmacs_one_core": gmacs,
        "avx2_int8_vs_f32": round(gmacs["i8_avx2"] / gmacs["f32_fma"], 3),
        "avx2_signed_int8_vs_f32": round(gmacs["signed_i8_avx2"] / gmacs["f32_fma"], 3),
    }
    if avx512:
        result["vnni_int8_vs_bf16"] = round(gmacs["i8_vnni"] / gmacs["bf16_dot"], 3)
    print_result(result)


if __name__ == "__main__":
    main()
