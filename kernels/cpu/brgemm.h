// The AMX path of kvferry's CPU kernels: the same packed weights, blocking and threads as the AVX-512 GEMMs,
// with oneDNN's batch-reduce GEMM microkernel (`at::native::cpublas::brgemm`, compiled into libtorch: no
// -mamx flags, no tile intrinsics here) doing each block's multiply-adds.
//
// Layouts. brgemm takes A row-major [M, K] (row stride ld_a), C row-major [M, N] (ld_c) and, with
// is_vnni, B in oneDNN's VNNI layout: [K / v][ld_b][v] with v = 2 for bf16 and 4 for int8, the v
// consecutive k of one column side by side. A column block of kvferry's packings is exactly that with
// ld_b = N = 16: bf16 pairs [Kp/2, 16, 2] (`pack_weight_bf16_pairs`) and the int8 rows [K/4, 16, 4]
// before the block's scales and compensations (`int8_gemm.h`). So weights are packed once, at load, in one
// layout that both the AVX-512 loops and the microkernel read, and the AVX-512 path stays the fallback for
// the very same tensors. (`brgemm_layout_check` compares the layout with oneDNN's own packing,
// `cpublas::pack`, where that exists: on AMX hosts.)
//
// Where it runs. cpublas::brgemm with is_vnni runs oneDNN's JIT microkernel for the best ISA it finds:
// AMX tiles on Sapphire Rapids and later, else AVX-512 (avx512_core_bf16 for bf16, avx512_core_vnni for
// int8). kernels/cpu.py turns the path on (`set_brgemm_min_rows`) only where the CPU has AMX, oneDNN can
// pack for it (`cpublas::could_pack`) and a self-check at load passes; tests force it on AVX-512 hosts to
// run the same blocking, tails and threads through oneDNN's AVX-512 microkernel.
//
// Tile state. oneDNN configures a thread's tiles (ldtilecfg) when the microkernel shape it calls changes and
// keeps the configuration between calls; a GEMM here calls one shape throughout (`call_rows`, `BR_SLACK`),
// so each thread configures its tiles once per GEMM call. Every function here releases them (`brgemm_release`)
// before it returns, so that no other oneDNN user on the thread (torch's own matmuls) finds a stale
// configuration, or leaves one behind that this code would trust.
//
// Numerics. int8: the same exact int32 sums as vpdpbusd / vpmaddubsw (unsigned activations q + I8_OFFSET
// against signed weights, the compensation row taking the offset back out), then the same float
// arithmetic, so AMX, VNNI, AVX2 and the torch reference agree bit for bit. bf16: the same bf16 inputs and
// float32 accumulation as vdpbf16ps, summed in another order (results within float32 rounding of it).
#pragma once

#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "int8_gemm.h"

namespace kvferry_cpu {

// Rows from which a GEMM takes the brgemm path (0: never, the AVX-512 / AVX2 loops serve everything). One
// process-wide setting, set at load by kernels/cpu.py: 1 where the path serves (every GEMM, so a row's
// result never depends on the rows beside it), 0 elsewhere; tests set others.
inline std::atomic<int64_t>& brgemm_min_rows_setting() {
  static std::atomic<int64_t> rows{0};
  return rows;
}

// whether a GEMM of M rows takes the brgemm path (torch's oneDNN switch respected: cpublas checks it too)
inline bool brgemm_serves(int64_t M) {
  const int64_t min_rows = brgemm_min_rows_setting().load(std::memory_order_relaxed);
  return min_rows > 0 && M >= min_rows && at::globalContext().userEnabledMkldnn();
}

// Releases the calling thread's tile state when it goes out of scope, on every exit path (an exception
// from the microkernel included), so that no other oneDNN user on the thread finds a stale configuration.
struct BrgemmRelease {
  BrgemmRelease() = default;
  BrgemmRelease(const BrgemmRelease&) = delete;
  BrgemmRelease& operator=(const BrgemmRelease&) = delete;
  ~BrgemmRelease() {
    try {
      at::native::cpublas::brgemm_release(true);
    } catch (...) {  // nothing to release on this thread, or no ukernel: never throw from here
    }
  }
};

constexpr int64_t BR_M = 64;  // rows per microkernel call at most (four 16-row tiles)
constexpr int64_t BR_N = 16;  // columns per call: one packed column block (one tile of B, 64 bytes a row)
// Rows an A operand must have readable past its M (zeros, or any finite values: other rows' data): every call
// of a GEMM takes the same number of rows, call_rows(M), the last one running past M. Its extra rows are
// computed and dropped. No copies, one microkernel shape a GEMM, so a thread configures its tiles once per call.
constexpr int64_t BR_SLACK = BR_M - 1;

// rows per microkernel call for a GEMM of M rows: M split evenly into blocks of at most BR_M rows, rounded up
// to whole 16-row tiles (a tile costs the same however many of its rows are used), so that few padding rows
// are computed (70 rows: 2 calls of 48, not 2 of 64); four shapes to compile per K and dtype
inline int64_t call_rows(int64_t M) {
  const int64_t blocks = (M + BR_M - 1) / BR_M, per = (M + blocks - 1) / blocks;
  return (per + 15) / 16 * 16;
}

// the rows of slack the A operand of a GEMM of M rows (or of a batch of GEMMs of up to M rows) needs: BR_SLACK
// where the brgemm path serves M rows, 0 where the loops do (they read no further)
inline int64_t brgemm_slack(int64_t M) { return brgemm_serves(M) ? BR_SLACK : 0; }

// column blocks [b0, b1) of out [M, N] (row stride ldo) = xb [M, Kp] bf16 (row stride Kp, BR_SLACK rows
// readable past M) @ the pair-packed weight w [ceil(N/16), Kp/2, 32]; serial (the caller's threads split the
// column blocks)
inline void brgemm_bf16_blocks(const uint16_t* xb, int64_t Kp, int64_t M, const uint16_t* w, int64_t N, float* out,
                               int64_t ldo, int64_t b0, int64_t b1) {
  BrgemmRelease release;
  alignas(64) float c[BR_M * BR_N];
  const int64_t rows = call_rows(M);
  const auto* A = reinterpret_cast<const at::BFloat16*>(xb);
  const auto* B = reinterpret_cast<const at::BFloat16*>(w);
  for (int64_t j = b0; j < b1; ++j) {
    const int64_t ncols = std::min<int64_t>(BR_N, N - j * BR_N);
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
      at::native::cpublas::brgemm(rows, BR_N, Kp, Kp, BR_N, BR_N, false, A + m0 * Kp, B + j * Kp * BR_N, c, true);
      float* o = out + m0 * ldo + j * BR_N;
      for (int64_t r = 0; r < std::min(rows, M - m0); ++r)
        std::memcpy(o + r * ldo, c + r * BR_N, ncols * sizeof(float));
    }
  }
}

// column blocks [b0, b1) of out [M, N] = int8 rows xq [M, K] (stored q + I8_OFFSET, scales xs; BR_SLACK rows
// readable past M) @ the int8 packing w [ceil(N/16), K/4 + 2, 64]; serial. out = float(acc - compensation) *
// (channel scale * row scale), the arithmetic of tile_i8 / tile_i8_avx2, element by element.
inline void brgemm_i8_blocks(const act_t* xq, const float* xs, int64_t K, int64_t M, const int8_t* w, int64_t N,
                             float* out, int64_t ldo, int64_t b0, int64_t b1) {
  BrgemmRelease release;
  alignas(64) int32_t c[BR_M * BR_N];
  const int64_t rows = call_rows(M), block = i8_block_bytes(K);
  const auto* A = reinterpret_cast<const unsigned char*>(xq);
  for (int64_t j = b0; j < b1; ++j) {
    const int8_t* wb = w + j * block;
    float sw[BR_N];
    int32_t comp[BR_N];
    std::memcpy(sw, wb + K * I8_NB, sizeof(sw));
    std::memcpy(comp, wb + K * I8_NB + 64, sizeof(comp));
    const int64_t ncols = std::min<int64_t>(BR_N, N - j * BR_N);
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
      const auto* B = reinterpret_cast<const signed char*>(wb);
      at::native::cpublas::brgemm(rows, BR_N, K, K, BR_N, BR_N, false, A + m0 * K, B, c, true);
      for (int64_t r = 0; r < std::min(rows, M - m0); ++r) {
        const float sx = xs[m0 + r];
        float* o = out + (m0 + r) * ldo + j * BR_N;
        const int32_t* acc = c + r * BR_N;
        for (int64_t n = 0; n < ncols; ++n) o[n] = static_cast<float>(acc[n] - comp[n]) * (sw[n] * sx);
      }
    }
  }
}

}  // namespace kvferry_cpu
