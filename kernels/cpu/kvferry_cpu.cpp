// kvferry's CPU kernels (float32 activations, AVX2 + FMA; bf16 dot products where the CPU has AVX512-BF16):
// the decode step's hot ops as single calls.
//
// Built on first use by kernels/cpu.py (torch.utils.cpp_extension) and registered as torch.ops.kvferry_cpu.*.
// Threads come from ATen's intra-op pool (at::parallel_for), so torch.set_num_threads governs them too.
//
// Packed weights: a [K, N] input-major matrix is stored as [ceil(N/16), K, 16] (column blocks of 16), so
// the GEMM streams each block's K x 16 floats front to back. Expert stacks [E, K, N] pack per expert.
//
// On CPUs with AMX the bf16-pair and int8 GEMMs (all of them, so a row's result never depends on its batch)
// run each column block through oneDNN's brgemm microkernel instead of the register-tiled loops: same packed
// weights, same threads and blocks (brgemm.h; chosen at load by kernels/cpu.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "brgemm.h"
#include "int8_gemm.h"
#include "vec_math.h"

#include <linux/futex.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <exception>
#include <string>
#include <cmath>
#include <limits>
#include <numeric>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

// t as a contiguous tensor of dtype `type`: t itself where it is one already, checked inline (a decode step
// passes its small index and rope tensors through many ops, and a dispatched no-op .to() costs about a
// microsecond each time)
at::Tensor as_contiguous(const at::Tensor& t, at::ScalarType type) {
  return t.scalar_type() == type && t.is_contiguous() ? t : t.to(type).contiguous();
}

using kvferry_cpu::exp8;
#ifdef KVFERRY_AVX512BF16
using kvferry_cpu::exp16;
#endif

constexpr int64_t NB = 16;  // columns per packed block (two 8-float AVX2 registers)
constexpr int MB = 6;       // rows per register tile: 12 accumulators + 2 weight registers + 1 broadcast

inline void store_row(float* out, __m256 lo, __m256 hi, int64_t ncols) {
  if (ncols == NB) {
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
  } else {  // the last block of a matrix whose N is not a multiple of 16
    alignas(32) float buf[NB];
    _mm256_store_ps(buf, lo);
    _mm256_store_ps(buf + 8, hi);
    std::copy(buf, buf + ncols, out);
  }
}

// 16 weights of one packed row as two float vectors: float32 as is, bfloat16 widened exactly (bf16 is the
// top half of a float32), so a bf16-stored weight computes the same float32 products at half the bytes.
inline void load16(const float* w, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}

inline void load16(const at::BFloat16* w, __m256& lo, __m256& hi) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
}

// out[m, 0:16] = x[m, :] . w[:, 0:16] for m < R; w: one packed block [K, 16]. The accumulators are named
// variables (not an array) so that they stay in registers.
template <int R, typename T>
inline void tile(const float* x, int64_t ldx, const T* w, int64_t K, float* out, int64_t ldo, int64_t ncols,
                 const char* next = nullptr) {
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0, b4 = a0,
         a5 = a0, b5 = a0;
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0, w1;
    load16(w + k * NB, w0, w1);
    kvferry_cpu::prefetch_next(next, k * NB * sizeof(T));
    __m256 xb = _mm256_broadcast_ss(x0 + k);
    a0 = _mm256_fmadd_ps(xb, w0, a0);
    b0 = _mm256_fmadd_ps(xb, w1, b0);
    if constexpr (R > 1) {
      xb = _mm256_broadcast_ss(x1 + k);
      a1 = _mm256_fmadd_ps(xb, w0, a1);
      b1 = _mm256_fmadd_ps(xb, w1, b1);
    }
    if constexpr (R > 2) {
      xb = _mm256_broadcast_ss(x2 + k);
      a2 = _mm256_fmadd_ps(xb, w0, a2);
      b2 = _mm256_fmadd_ps(xb, w1, b2);
    }
    if constexpr (R > 3) {
      xb = _mm256_broadcast_ss(x3 + k);
      a3 = _mm256_fmadd_ps(xb, w0, a3);
      b3 = _mm256_fmadd_ps(xb, w1, b3);
    }
    if constexpr (R > 4) {
      xb = _mm256_broadcast_ss(x4 + k);
      a4 = _mm256_fmadd_ps(xb, w0, a4);
      b4 = _mm256_fmadd_ps(xb, w1, b4);
    }
    if constexpr (R > 5) {
      xb = _mm256_broadcast_ss(x5 + k);
      a5 = _mm256_fmadd_ps(xb, w0, a5);
      b5 = _mm256_fmadd_ps(xb, w1, b5);
    }
  }
  store_row(out, a0, b0, ncols);
  if constexpr (R > 1) store_row(out + ldo, a1, b1, ncols);
  if constexpr (R > 2) store_row(out + 2 * ldo, a2, b2, ncols);
  if constexpr (R > 3) store_row(out + 3 * ldo, a3, b3, ncols);
  if constexpr (R > 4) store_row(out + 4 * ldo, a4, b4, ncols);
  if constexpr (R > 5) store_row(out + 5 * ldo, a5, b5, ncols);
}

template <typename T>
void tile_rows(int64_t rows, const float* x, int64_t ldx, const T* w, int64_t K, float* out, int64_t ldo,
               int64_t ncols, const char* next = nullptr) {
  switch (rows) {
    case 1: return tile<1>(x, ldx, w, K, out, ldo, ncols, next);
    case 2: return tile<2>(x, ldx, w, K, out, ldo, ncols, next);
    case 3: return tile<3>(x, ldx, w, K, out, ldo, ncols, next);
    case 4: return tile<4>(x, ldx, w, K, out, ldo, ncols, next);
    case 5: return tile<5>(x, ldx, w, K, out, ldo, ncols, next);
    default: return tile<MB>(x, ldx, w, K, out, ldo, ncols, next);
  }
}

// Decode's few rows: out[r, 16c : 16c + 16] = x[r, :] . block c for r < R, c < C (the C blocks [K, 16] follow
// each other from w; N counts from the tile's first column). 2 R C accumulator chains and C weight streams at
// once, where one block at a time has two chains and the FMA latency, not the memory, sets the pace. Each
// output still sums its k in order, so a row's result is the same whatever the tile.
template <int R, int C, typename T>
inline void tile_wide(const float* x, int64_t ldx, const T* w, int64_t K, float* out, int64_t ldo, int64_t N) {
  __m256 lo[R][C], hi[R][C];
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) lo[r][c] = hi[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 xb[R];
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) xb[r] = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      __m256 w0, w1;
      load16(w + (c * K + k) * NB, w0, w1);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        lo[r][c] = _mm256_fmadd_ps(xb[r], w0, lo[r][c]);
        hi[r][c] = _mm256_fmadd_ps(xb[r], w1, hi[r][c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    const int64_t ncols = std::min<int64_t>(NB, N - c * NB);
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) store_row(out + r * ldo + c * NB, lo[r][c], hi[r][c], ncols);
  }
}

// column blocks [b0, b1) for R <= 2 rows, C blocks per tile (R = 1: 4, R = 2: 2; 8 accumulators either way),
// the blocks left over one at a time (the one-block tile)
template <int R, typename T>
void few_rows(const float* x, int64_t ldx, int64_t K, const T* w, int64_t N, float* out, int64_t ldo, int64_t b0,
              int64_t b1) {
  constexpr int C = R == 1 ? 4 : 2;
  const int64_t block = K * NB;
  int64_t j = b0;
  for (; j + C <= b1; j += C) tile_wide<R, C>(x, ldx, w + j * block, K, out + j * NB, ldo, N - j * NB);
  for (; j < b1; ++j) tile<R>(x, ldx, w + j * block, K, out + j * NB, ldo, std::min<int64_t>(NB, N - j * NB));
}

// out [M, N] (row stride ldo) = x [M, K] (row stride ldx) @ packed w [nblocks, K, 16]; serial
template <typename T>
void gemm_serial(const float* x, int64_t ldx, int64_t M, int64_t K, const T* w, int64_t N, float* out,
                 int64_t ldo, int64_t b0, int64_t b1) {
  // bf16 blocks feeding more than one row tile are widened once into a float32 copy (K x 16, cache
  // resident) instead of once per tile: decode (few rows) reads half the bytes, prefill pays no widening
  if (M == 1) return few_rows<1>(x, ldx, K, w, N, out, ldo, b0, b1);
  if (M == 2) return few_rows<2>(x, ldx, K, w, N, out, ldo, b0, b1);
  const bool widen_once = !std::is_same_v<T, float> && M > MB;
  thread_local std::vector<float> wide;
  if (widen_once) wide.resize(K * NB);
  for (int64_t j = b0; j < b1; ++j) {
    const int64_t ncols = std::min<int64_t>(NB, N - j * NB);
    const T* block = w + j * K * NB;
    const char* next = kvferry_cpu::next_block(block + K * NB, j + 1 < b1 && M > MB);
    if (widen_once) {
      for (int64_t k = 0; k < K; ++k) {
        __m256 lo, hi;
        load16(block + k * NB, lo, hi);
        kvferry_cpu::prefetch_next(next, k * NB * sizeof(T));
        _mm256_storeu_ps(wide.data() + k * NB, lo);
        _mm256_storeu_ps(wide.data() + k * NB + 8, hi);
      }
    }
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t rows = std::min<int64_t>(MB, M - m0);
      if (widen_once)
        tile_rows(rows, x + m0 * ldx, ldx, wide.data(), K, out + m0 * ldo + j * NB, ldo, ncols);
      else
        tile_rows(rows, x + m0 * ldx, ldx, block, K, out + m0 * ldo + j * NB, ldo, ncols, m0 ? nullptr : next);
    }
  }
}

#ifdef KVFERRY_AVX512BF16
// bf16 dot products (AVX512-BF16): the weight is packed in k pairs, [ceil(N/16), ceil(K/2), 16, 2] bf16, and
// the activations are rounded to bf16 (round to nearest even), so one vdpbf16ps does 32 multiply-adds into
// 16 float32 accumulators. Padding k (odd K) and padding columns are zero.
constexpr int MBW = 8;  // rows per register tile: 8 accumulators + 1 weight + 1 broadcast of 32 zmm

// one row of float32 -> bf16 (round to nearest even), zero-padded from K to Kp
inline void row_to_bf16(const float* src, int64_t K, uint16_t* dst, int64_t Kp) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k)));
  if (k < Kp) {  // the tail, and the zero that pads an odd K
    const __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
    const __m256bh tail = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + k));
    _mm256_mask_storeu_epi16(dst + k, (__mmask16)((1u << (Kp - k)) - 1), (__m256i)tail);
  }
}

// x [M, K] float32 (row stride ldx) -> xb [M, Kp] bf16 pairs (Kp = K rounded up to even, zero-padded)
void to_bf16_pairs(const float* x, int64_t ldx, int64_t M, int64_t K, uint16_t* xb, int64_t Kp) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) row_to_bf16(x + m * ldx, K, xb + m * Kp, Kp);
  });
}

// out[m, 16c : 16c + 16] = xb[m, :] . block c for m < R, c < C, over Kp/2 k pairs; the C blocks [Kp/2, 32]
// follow each other from w. R * C accumulators are R * C independent chains: a decode row (R = 1) runs C = 4
// blocks at once so that the dot-product latency hides; each output still sums its k pairs in order, so a
// row's result is the same whatever the tile.
template <int R, int C>
inline void tile_bf16(const uint16_t* xb, int64_t Kp, const uint16_t* w, float* out, int64_t ldo, int64_t N,
                      const char* next = nullptr) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(xb);
  const int64_t pairs = Kp / 2, stride = pairs * 32;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * stride + p * 32);
    kvferry_cpu::prefetch_next(next, p * 64);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[r * pairs + p]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    const int64_t ncols = std::min<int64_t>(NB, N - c * NB);  // N counts from this tile's first column
    const __mmask16 mask = (__mmask16)((1u << ncols) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * ldo + c * NB, mask, acc[r][c]);
  }
}

void tile_rows_bf16(int64_t rows, const uint16_t* xb, int64_t Kp, const uint16_t* w, float* out, int64_t ldo,
                    int64_t N, const char* next) {
  switch (rows) {
    case 1: return tile_bf16<1, 1>(xb, Kp, w, out, ldo, N, next);
    case 2: return tile_bf16<2, 1>(xb, Kp, w, out, ldo, N, next);
    case 3: return tile_bf16<3, 1>(xb, Kp, w, out, ldo, N, next);
    case 4: return tile_bf16<4, 1>(xb, Kp, w, out, ldo, N, next);
    case 5: return tile_bf16<5, 1>(xb, Kp, w, out, ldo, N, next);
    case 6: return tile_bf16<6, 1>(xb, Kp, w, out, ldo, N, next);
    case 7: return tile_bf16<7, 1>(xb, Kp, w, out, ldo, N, next);
    default: return tile_bf16<MBW, 1>(xb, Kp, w, out, ldo, N, next);
  }
}

// column blocks [b0, b1) for R <= 8 rows: C blocks per tile (R * C accumulator chains: enough independent
// dot products in flight to hide their latency, and C weight streams read at once)
template <int R>
void few_rows_bf16(const uint16_t* xb, int64_t Kp, const uint16_t* w, int64_t N, float* out, int64_t ldo, int64_t b0,
                   int64_t b1) {
  constexpr int C = R <= 4 ? 4 : 2;
  const int64_t block = Kp * NB;
  int64_t j = b0;
  for (; j + C <= b1; j += C) tile_bf16<R, C>(xb, Kp, w + j * block, out + j * NB, ldo, N - j * NB);
  for (; j < b1; ++j) tile_bf16<R, 1>(xb, Kp, w + j * block, out + j * NB, ldo, N - j * NB);
}

// out [M, N] = xb [M, Kp] (bf16 pairs) @ the pair-packed column blocks b0..b1-1 of w; serial. Up to 8 rows:
// wide tiles; more: 8-row tiles one block at a time, all row tiles over a block while it sits in L1.
void gemm_bf16_blocks(const uint16_t* xb, int64_t Kp, int64_t M, const uint16_t* w, int64_t N, float* out, int64_t ldo,
                      int64_t b0, int64_t b1) {
  switch (M) {
    case 1: return few_rows_bf16<1>(xb, Kp, w, N, out, ldo, b0, b1);
    case 2: return few_rows_bf16<2>(xb, Kp, w, N, out, ldo, b0, b1);
    case 3: return few_rows_bf16<3>(xb, Kp, w, N, out, ldo, b0, b1);
    case 4: return few_rows_bf16<4>(xb, Kp, w, N, out, ldo, b0, b1);
    case 5: return few_rows_bf16<5>(xb, Kp, w, N, out, ldo, b0, b1);
    case 6: return few_rows_bf16<6>(xb, Kp, w, N, out, ldo, b0, b1);
    case 7: return few_rows_bf16<7>(xb, Kp, w, N, out, ldo, b0, b1);
    case 8: return few_rows_bf16<8>(xb, Kp, w, N, out, ldo, b0, b1);
    default: break;
  }
  const int64_t block = Kp * NB;
  for (int64_t j = b0; j < b1; ++j) {
    const char* next = kvferry_cpu::next_block(w + (j + 1) * block, j + 1 < b1);
    for (int64_t m0 = 0; m0 < M; m0 += MBW)
      tile_rows_bf16(std::min<int64_t>(MBW, M - m0), xb + m0 * Kp, Kp, w + j * block, out + m0 * ldo + j * NB, ldo,
                     N - j * NB, m0 ? nullptr : next);
  }
}

#endif

bool is_int8(const at::Tensor& w) { return w.scalar_type() == at::kChar; }

bool is_bf16_pairs(const at::Tensor& w) { return !is_int8(w) && w.size(-1) == 2 * NB; }

// K of a packed weight (for bf16 pairs: K rounded up to even; int8: the rows before the scales, 4 k each)
int64_t packed_k(const at::Tensor& w) {
  if (is_int8(w)) return 4 * (w.size(-2) - 2);
  return is_bf16_pairs(w) ? 2 * w.size(-2) : w.size(-2);
}

// Where a packed weight's data starts (`expert`: that expert of a packed stack [E, ...]) and how it is stored;
// the one place that tells the layouts apart.
struct Packed {
  const void* data = nullptr;
  bool pairs = false, bf16 = false, i8 = false;
  Packed() = default;
  explicit Packed(const at::Tensor& w, int64_t expert = 0)
      : data(static_cast<const char*>(w.data_ptr()) + expert * w.stride(0) * w.element_size()),
        pairs(is_bf16_pairs(w)),
        bf16(w.scalar_type() == at::kBFloat16),
        i8(is_int8(w)) {}
};

// An input prepared for a packed weight's layout: float32 rows x (row stride ldx); their bf16 copy xb for
// bf16-pair weights (row stride K, K even); their int8 rows xq with per-row scales xs for int8 weights
// (row stride K). slack: xb / xq have kvferry_cpu::BR_SLACK more rows readable past the last (the brgemm
// path reads whole row blocks).
struct Rows {
  const float* x = nullptr;
  int64_t ldx = 0;
  const uint16_t* xb = nullptr;
  const kvferry_cpu::act_t* xq = nullptr;
  const float* xs = nullptr;
  bool slack = false;
  Rows offset(int64_t r, int64_t K) const {  // the rows from row r on
    return {x ? x + r * ldx : nullptr, ldx, xb ? xb + r * K : nullptr, xq ? xq + r * K : nullptr,
            xs ? xs + r : nullptr, slack};
  }
};

// column blocks [b0, b1) of out [M, N] (row stride ldo) = input [M, K] @ w; serial. bf16-pair and int8
// weights go through oneDNN's brgemm where that path is on and serves M rows (brgemm.h), else the loops here.
void gemm_blocks(const Packed& w, const Rows& in, int64_t M, int64_t K, int64_t N, float* out, int64_t ldo, int64_t b0,
                 int64_t b1) {
  const float* x = in.x;
  const int64_t ldx = in.ldx;
  const uint16_t* xb = in.xb;
  const bool tiles = in.slack && kvferry_cpu::brgemm_serves(M);
  if (w.i8) {
    const auto* wq = static_cast<const int8_t*>(w.data);
    if (tiles)
      return kvferry_cpu::brgemm_i8_blocks(in.xq, in.xs, K, M, wq, N, out, ldo, b0, b1);
    return kvferry_cpu::gemm_i8_blocks(in.xq, in.xs, K, M, wq, N, out, ldo, b0, b1);
  }
  if (w.pairs) {
#ifdef KVFERRY_AVX512BF16
    const auto* wb = static_cast<const uint16_t*>(w.data);
    if (tiles) return kvferry_cpu::brgemm_bf16_blocks(xb, K, M, wb, N, out, ldo, b0, b1);
    return gemm_bf16_blocks(xb, K, M, wb, N, out, ldo, b0, b1);
#else
    TORCH_CHECK(false, "bf16-pair weights need the AVX512-BF16 build of the kernels");
#endif
  }
  if (w.bf16)
    gemm_serial(x, ldx, M, K, static_cast<const at::BFloat16*>(w.data), N, out, ldo, b0, b1);
  else
    gemm_serial(x, ldx, M, K, static_cast<const float*>(w.data), N, out, ldo, b0, b1);
}

// out [M, N] (row stride ldo) = x [M, K] (row stride ldx) @ a packed weight of any layout; threads split the
// column blocks (bf16-pair weights first round x to bf16)
void gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const at::Tensor& weight, int64_t N, float* out,
          int64_t ldo) {
  const Packed w(weight);
  const int64_t Kp = packed_k(weight), slack = kvferry_cpu::brgemm_slack(M);  // rows the brgemm path reads past M
  std::vector<uint16_t> xb(w.pairs ? (M + slack) * Kp : 0);
  std::vector<kvferry_cpu::act_t> xq(w.i8 ? (M + slack) * K : 0);
  std::vector<float> xs(w.i8 ? M : 0);
#ifdef KVFERRY_AVX512BF16
  if (w.pairs) to_bf16_pairs(x, ldx, M, K, xb.data(), Kp);
#endif
  if (w.i8) kvferry_cpu::quantize_rows(x, ldx, M, K, xq.data(), xs.data());
  const Rows in{x, ldx, xb.data(), xq.data(), xs.data(), slack > 0};
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t b0, int64_t b1) {
    gemm_blocks(w, in, M, w.pairs ? Kp : K, N, out, ldo, b0, b1);
  });
}

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

inline float dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float sum = hsum(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {  // y += alpha * x
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// y = 0 + alpha * x, what axpy gives on a zeroed y (without writing the zeros first)
inline void axpy_to_zero(float alpha, const float* x, float* y, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), zero));
  for (; i < n; ++i) y[i] = 0.f + alpha * x[i];
}

// s[i] = e^(s[i] * scale - peak) for i < n; returns their sum
inline float exp_scaled(float* s, int64_t n, float scale, float peak) {
  const __m256 vs = _mm256_set1_ps(scale), vp = _mm256_set1_ps(peak);
  __m256 total = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(s + i), vs, vp));
    _mm256_storeu_ps(s + i, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] * scale - peak));
  return sum;
}

// each of `rows` score rows s[r * n, (r + 1) * n) becomes softmax(scale * row), in place
inline void softmax_rows(float* s, int64_t rows, int64_t n, float scale) {
  for (int64_t r = 0; r < rows; ++r, s += n) {
    const float peak = *std::max_element(s, s + n) * scale;
    const float inv = 1.f / exp_scaled(s, n, scale, peak);
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
  }
}

// g [2I] = [gate | up] -> silu(gate) * up, written into the gate half
inline void silu_mul(float* g, int64_t I) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    const __m256 gate = _mm256_loadu_ps(g + i);
    const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gate))));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(silu, _mm256_loadu_ps(g + I + i)));
  }
  for (; i < I; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
}

// The 8 horizontal sums of v[0..7], as one vector (a transpose-and-add tree instead of 8 separate hsums).
inline __m256 hsum8(const __m256* v) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // lanes: s0123 = [0 1 2 3 | 0 1 2 3] halves, s4567 likewise: add the low and high 128-bit halves
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

// scores[0..7] = q . k_t for the 8 rows k_0..k_7 (row stride D), D % 8 == 0
inline void dot8(const float* q, const float* k, int64_t D, float* scores) {
  __m256 acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + r * D + i), acc[r]);
  }
  _mm256_storeu_ps(scores, hsum8(acc));
}

// the next KV block's K and V rows, fetched while this block is computed (blocks are scattered)
inline void prefetch_block(const float* k, const float* v, int64_t offset, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(k + offset + i), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(v + offset + i), _MM_HINT_T1);
  }
}

#ifdef KVFERRY_AVX512BF16
// AVX-512 decode attention (this build's CPUs have AVX-512F): D a multiple of 16 up to 128, DV = D / 16
// registers per row. Same two passes as the AVX2 kernel below, with the partial sums kept in registers.

// lane i = the horizontal sum of v[i], i < 16: a transpose-and-add tree (30 shuffles and 15 adds for 16 sums)
inline __m512 hsum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit chunk: [v2i, v2i+1, v2i, v2i+1] partial sums
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j)  // chunk c of b[j]: sources 4j..4j+3, summed over chunk c of each
    b[j] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // chunk j of the result: the four chunks of b[j] added
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// s[g * ld + t] = q_g . k_t for the n <= 16 rows rows[0..n) and the G query heads q [G, D]
template <int DV>
inline void scores16(const float* q, int64_t G, const float* const* rows, int64_t n, float* s, int64_t ld) {
  for (int64_t g = 0; g < G; ++g) {
    __m512 qv[DV], acc[16];
    for (int c = 0; c < DV; ++c) qv[c] = _mm512_loadu_ps(q + g * DV * 16 + c * 16);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      acc[i] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(rows[i]));
      for (int c = 1; c < DV; ++c) acc[i] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows[i] + c * 16), acc[i]);
    }
    _mm512_mask_storeu_ps(s + g * ld, (__mmask16)((1u << n) - 1), hsum16(acc));
  }
}

// out [GC, D] = inv_g * sum_t p[g * ld + t] v_t for GC query heads (GC * DV accumulators in registers)
template <int DV, int GC>
inline void weighted_rows(const float* p, int64_t ld, const float* vc, const int64_t* row_offsets, int64_t len,
                          const float* inv, float* out) {
  __m512 acc[GC][DV];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < DV; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const float* v = vc + row_offsets[t];
    __m512 vv[DV];
    for (int c = 0; c < DV; ++c) vv[c] = _mm512_loadu_ps(v + c * 16);
    for (int g = 0; g < GC; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * ld + t]);
      for (int c = 0; c < DV; ++c) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < DV; ++c)
      _mm512_storeu_ps(out + g * DV * 16 + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
}

template <int DV>
void weighted_heads(const float* p, int64_t ld, const float* vc, const int64_t* row_offsets, int64_t len,
                    const float* inv, int64_t G, float* out) {
  constexpr int64_t MAXG = 16 / DV;  // heads per pass: at most 16 accumulators
  for (int64_t g = 0; g < G;) {
    const int64_t n = std::min(G - g, MAXG), D = DV * 16;
    float* o = out + g * D;
    if (n >= 8 && MAXG >= 8) {
      weighted_rows<DV, (MAXG >= 8 ? 8 : 1)>(p + g * ld, ld, vc, row_offsets, len, inv + g, o);
      g += 8;
    } else if (n >= 4 && MAXG >= 4) {
      weighted_rows<DV, (MAXG >= 4 ? 4 : 1)>(p + g * ld, ld, vc, row_offsets, len, inv + g, o);
      g += 4;
    } else if (n >= 2) {
      weighted_rows<DV, 2>(p + g * ld, ld, vc, row_offsets, len, inv + g, o);
      g += 2;
    } else {
      weighted_rows<DV, 1>(p + g * ld, ld, vc, row_offsets, len, inv + g, o);
      g += 1;
    }
  }
}

// One (sequence, KV head) of paged_decode_attention: q [G, D] (the heads that read KV head h); offsets [len]
// is each cached row's float offset within the K (and V) cache. scratch holds G * ceil16(len) scores.
template <int DV>
void attend_avx512(const float* q, int64_t G, const float* kc, const float* vc, const int64_t* offsets, int64_t len,
                   float scale, float* scores, float* out) {
  const int64_t ld = (len + 15) / 16 * 16;
  const float* rows[16];
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - t0);
    for (int64_t t = t0 + 16; t < std::min(t0 + 32, len); ++t)  // the next rows, while these are computed
      for (int c = 0; c < DV; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(kc + offsets[t] + c * 16), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vc + offsets[t] + c * 16), _MM_HINT_T1);
      }
    for (int64_t i = 0; i < 16; ++i) rows[i] = kc + offsets[t0 + std::min(i, n - 1)];
    scores16<DV>(q, G, rows, n, scores + t0, ld);
  }
  float inv[128];  // G <= 128 query heads per KV head (checked by the caller)
  const __mmask16 tail = (__mmask16)((1u << (len % 16 ? len % 16 : 16)) - 1);
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * ld;
    __m512 peak = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < ld; t += 16)
      peak = _mm512_mask_max_ps(peak, t + 16 < ld ? 0xFFFF : tail, peak, _mm512_loadu_ps(s + t));
    const float m = _mm512_reduce_max_ps(peak);
    const __m512 vs = _mm512_set1_ps(scale), vp = _mm512_set1_ps(m * scale);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < ld; t += 16) {
      const __mmask16 mask = t + 16 < ld ? 0xFFFF : tail;
      const __m512 e = exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(mask, s + t), vs, vp));
      _mm512_mask_storeu_ps(s + t, mask, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
    }
    inv[g] = 1.f / _mm512_reduce_add_ps(total);
  }
  weighted_heads<DV>(scores, ld, vc, offsets, len, inv, G, out);
}
#endif

float rms_scale(const float* x, int64_t n, double eps) {
  return 1.f / std::sqrt(dot(x, x, n) / n + static_cast<float>(eps));
}

}  // namespace

namespace {

// w is a packed weight (any layout) for inputs of K values and n outputs
void check_packed(const at::Tensor& w, int64_t K, int64_t n) {
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 || is_int8(w),
              "w must be float32, bfloat16 or int8");
  const bool pairs = w.dim() == 3 && is_bf16_pairs(w), i8 = is_int8(w);
  const int64_t rows = i8 ? K / 4 + 2 : (pairs ? (K + 1) / 2 : K), width = i8 ? 4 * NB : (pairs ? 2 * NB : NB);
  TORCH_CHECK(w.dim() == 3 && (!i8 || K % 4 == 0) && w.size(1) == rows && w.size(2) == width && w.size(0) * NB >= n,
              "packed weight shape");
}

}  // namespace

// x [M, K] @ packed [nblocks, K, 16] (float32 or bfloat16) -> [M, n]
at::Tensor packed_linear(const at::Tensor& x_, const at::Tensor& w, int64_t n) {
  check_f32(x_, "x");
  auto x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  check_packed(w, K, n);
  auto out = at::empty({M, n}, x.options());
  if (M > 0) gemm(x.data_ptr<float>(), K, M, K, w, n, out.data_ptr<float>(), n);
  return out;
}

// [K, N] -> [ceil(N/16), K, 16], zero-padded columns, in w's dtype
at::Tensor pack_weight(const at::Tensor& w) {
  const int64_t K = w.size(0), N = w.size(1), nblocks = (N + NB - 1) / NB;
  auto padded = at::zeros({K, nblocks * NB}, w.options());
  padded.narrow(1, 0, N).copy_(w);
  return padded.view({K, nblocks, NB}).transpose(0, 1).contiguous();
}

// [K, N] -> bf16 pairs [ceil(N/16), ceil(K/2), 32]: element (p, 2c + j) is w[2p + j, 16 b + c] (zero-padded)
at::Tensor pack_weight_bf16_pairs(const at::Tensor& w) {
  const int64_t K = w.size(0), N = w.size(1), nblocks = (N + NB - 1) / NB, Kp = (K + 1) / 2 * 2;
  auto padded = at::zeros({Kp, nblocks * NB}, w.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, K).narrow(1, 0, N).copy_(w);
  // [Kp/2, 2, nblocks, 16] -> [nblocks, Kp/2, 16, 2]
  return padded.view({Kp / 2, 2, nblocks, NB}).permute({2, 0, 3, 1}).contiguous().view({nblocks, Kp / 2, 2 * NB});
}

// int8 q [K, N] (K a multiple of 4, values in [-127, 127]) and float32 channel scales [N] -> the int8 packing
// [ceil(N/16), K/4 + 2, 64] of int8_gemm.h (block rows of 4 k x 16 columns, then scales, then this build's
// I8_OFFSET * sum_k q)
at::Tensor pack_weight_int8(const at::Tensor& q_, const at::Tensor& scale_) {
  TORCH_CHECK(q_.scalar_type() == at::kChar && q_.dim() == 2, "q must be int8 [K, N]");
  const int64_t K = q_.size(0), N = q_.size(1), nblocks = (N + NB - 1) / NB;
  TORCH_CHECK(K % 4 == 0, "int8 packing needs K a multiple of 4, got ", K);
  TORCH_CHECK(scale_.numel() == N, "scale must have N = ", N, " entries");
  auto q = q_.contiguous();
  auto scale = as_contiguous(scale_, at::kFloat);
  auto padded = at::zeros({K, nblocks * NB}, q.options());
  padded.narrow(1, 0, N).copy_(q);
  // [K/4, 4, nblocks, 16] -> [nblocks, K/4, 16, 4]
  auto body = padded.view({K / 4, 4, nblocks, NB}).permute({2, 0, 3, 1}).contiguous().view({nblocks, K / 4, 4 * NB});
  auto out = at::empty({nblocks, K / 4 + 2, 4 * NB}, q.options());
  out.narrow(1, 0, K / 4).copy_(body);
  auto comp = at::zeros({nblocks * NB}, q.options().dtype(at::kInt));
  comp.narrow(0, 0, N).copy_(q.to(at::kInt).sum(0).mul_(kvferry_cpu::I8_OFFSET));
  auto scales = at::zeros({nblocks * NB}, scale.options());
  scales.narrow(0, 0, N).copy_(scale);
  int8_t* op = out.data_ptr<int8_t>();
  const int64_t block = (K / 4 + 2) * 4 * NB;
  for (int64_t b = 0; b < nblocks; ++b) {
    std::memcpy(op + b * block + K * NB, scales.data_ptr<float>() + b * NB, NB * sizeof(float));
    std::memcpy(op + b * block + K * NB + 64, comp.data_ptr<int32_t>() + b * NB, NB * sizeof(int32_t));
  }
  return out;
}

bool has_int8_dot() {  // which int8 inner loop this build has: true for vpdpbusd (AVX512-VNNI), false for AVX2
#ifdef KVFERRY_AVX512VNNI
  return true;
#else
  return false;
#endif
}

// the activations' int8 range [-q, q] of this build's int8 GEMM: 127 (AVX512-VNNI), 63 (AVX2: see int8_gemm.h)
int64_t int8_act_qmax() { return kvferry_cpu::I8_ACT_QMAX; }

bool has_bf16_dot() {
#ifdef KVFERRY_AVX512BF16
  return true;
#else
  return false;
#endif
}

// The brgemm path (brgemm.h): from how many rows a bf16-pair or int8 GEMM takes it (0: off); returns the
// previous setting. kernels/cpu.py sets it at load where the CPU has AMX and the self-check passes.
int64_t set_brgemm_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "set_brgemm_min_rows: rows must be >= 0 (0: off)");
  return kvferry_cpu::brgemm_min_rows_setting().exchange(rows);
}

int64_t brgemm_min_rows() { return kvferry_cpu::brgemm_min_rows_setting().load(); }

// oneDNN can pack bf16 and int8 for its AMX microkernel here (cpublas::could_pack: AMX, oneDNN enabled)
bool amx_could_pack() {
  return at::native::cpublas::could_pack(at::kBFloat16) && at::native::cpublas::could_pack(at::kChar);
}

// Whether cpublas::brgemm runs here with VNNI-packed B for both bf16 x bf16 -> f32 and u8 x s8 -> s32 and
// gives the exact sums of small integers (oneDNN's microkernel: AMX, or AVX-512 with BF16 / VNNI); false
// where it throws (AVX2-only CPUs, oneDNN disabled). What tests check before forcing the path without AMX.
bool brgemm_runs() {
  constexpr int64_t M = 3, K = 32, N = 16;
  std::vector<at::BFloat16> a(M * K), b(K * N);
  std::vector<uint8_t> a8(M * K);
  std::vector<int8_t> b8(K * N);
  std::vector<float> c(M * N);
  std::vector<int32_t> c8(M * N);
  auto av = [](int64_t m, int64_t k) { return static_cast<int>((m * 7 + k * 3) % 11) - 5; };
  auto bv = [](int64_t k, int64_t n) { return static_cast<int>((k * 5 + n * 2) % 13) - 6; };
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      a[m * K + k] = static_cast<float>(av(m, k));
      a8[m * K + k] = static_cast<uint8_t>(av(m, k) + 128);
    }
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) {
      b[(k / 2) * N * 2 + n * 2 + k % 2] = static_cast<float>(bv(k, n));  // [K/2][N][2]
      b8[(k / 4) * N * 4 + n * 4 + k % 4] = static_cast<int8_t>(bv(k, n));  // [K/4][N][4]
    }
  try {
    at::native::cpublas::brgemm(M, N, K, K, N, N, false, a.data(), b.data(), c.data(), true);
    at::native::cpublas::brgemm(M, N, K, K, N, N, false, a8.data(), b8.data(), c8.data(), true);
    at::native::cpublas::brgemm_release(true);
  } catch (const std::exception&) {
    at::native::cpublas::brgemm_release(true);
    return false;
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      int64_t sum = 0, sum8 = 0;
      for (int64_t k = 0; k < K; ++k) {
        sum += av(m, k) * bv(k, n);
        sum8 += (av(m, k) + 128) * bv(k, n);
      }
      if (c[m * N + n] != static_cast<float>(sum) || c8[m * N + n] != sum8) return false;
    }
  return true;
}

// kvferry's bf16-pair and int8 block layouts against oneDNN's own VNNI packing for its microkernel
// (cpublas::pack of a [64, 16] block with ld_out 16): per dtype 1 = the same bytes, 0 = different, -1 = oneDNN
// cannot pack here (no AMX) or threw.
std::vector<int64_t> brgemm_layout_check() {
  constexpr int64_t K = 64, N = 16;
  std::vector<int64_t> result;
  auto w = at::arange(K * N, at::kFloat).remainder_(37).sub_(18).mul_(0.25).view({K, N});
  {  // bf16 pairs
    auto in = w.to(at::kBFloat16).contiguous();
    auto ours = pack_weight_bf16_pairs(in);
    auto theirs = at::zeros({2 * K * N}, at::kBFloat16);
    int64_t status = -1;
    if (at::native::cpublas::could_pack(at::kBFloat16)) {
      try {
        at::native::cpublas::pack(K, N, N, N, at::kBFloat16, at::kBFloat16, in.data_ptr(), theirs.data_ptr());
        status = std::memcmp(ours.data_ptr(), theirs.data_ptr(), K * N * 2) == 0 ? 1 : 0;
      } catch (const std::exception&) {
      }
    }
    result.push_back(status);
  }
  {  // int8: the block's body, before its scales and compensations
    auto q = w.mul(4).to(at::kChar).contiguous();
    auto ours = pack_weight_int8(q, at::ones({N}, at::kFloat));
    auto theirs = at::zeros({2 * K * N}, at::kChar);
    int64_t status = -1;
    if (at::native::cpublas::could_pack(at::kChar)) {
      try {
        at::native::cpublas::pack(K, N, N, N, at::kChar, at::kChar, q.data_ptr(), theirs.data_ptr());
        status = std::memcmp(ours.data_ptr(), theirs.data_ptr(), K * N) == 0 ? 1 : 0;
      } catch (const std::exception&) {
      }
    }
    result.push_back(status);
  }
  return result;
}

// HF RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * weight
namespace {

// out [T, H] (row stride ldo) = rms_norm of x's rows (row stride ldx) times weight
void rms_norm_rows(const float* xp, int64_t ldx, int64_t T, int64_t H, const float* wp, double eps, float* op,
                   int64_t ldo) {
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float s = rms_scale(xp + t * ldx, H, eps);
      for (int64_t i = 0; i < H; ++i) op[t * ldo + i] = xp[t * ldx + i] * s * wp[i];
    }
  });
}

// residual [T, H] += x (in place); out = rms_norm(residual) times weight
void add_rms_norm_rows(const float* xp, float* rp, int64_t T, int64_t H, const float* wp, double eps, float* op) {
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* r = rp + t * H;
      for (int64_t i = 0; i < H; ++i) r[i] += xp[t * H + i];
      const float s = rms_scale(r, H, eps);
      for (int64_t i = 0; i < H; ++i) op[t * H + i] = r[i] * s * wp[i];
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& weight, double eps) {
  check_f32(x_, "x");
  auto x = x_.contiguous();
  const int64_t H = x.size(-1), T = x.numel() / std::max<int64_t>(H, 1);
  auto out = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), H, T, H, weight.data_ptr<float>(), eps, out.data_ptr<float>(), H);
  return out;
}

// residual += x (in place), returns rms_norm(residual)
at::Tensor add_rms_norm(const at::Tensor& x_, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_f32(residual, "residual");
  TORCH_CHECK(residual.is_contiguous(), "residual must be contiguous");
  auto x = x_.contiguous();
  const int64_t H = x.size(-1), T = x.numel() / std::max<int64_t>(H, 1);
  auto out = at::empty_like(residual);
  add_rms_norm_rows(x.data_ptr<float>(), residual.data_ptr<float>(), T, H, weight.data_ptr<float>(), eps,
                    out.data_ptr<float>());
  return out;
}

// qkv [T, (Hq + 2 Hkv) * D]: RMS-normalise every q and k head (q_weight / k_weight [D]; both empty: no
// norms, as in Llama) and rotate it (HF's non-interleaved RoPE: x * cos + roll(x, D/2) * sin_signed,
// cos / sin_signed [T, D] at each token's position); write k and v into their cache slots (caches
// [Hkv, num_blocks, bs, D]). Returns the rotated q and k heads, [T, Hq + Hkv, D].
at::Tensor qk_norm_rope_store(const at::Tensor& qkv_, const at::Tensor& q_weight, const at::Tensor& k_weight,
                              double eps, const at::Tensor& cos_, const at::Tensor& sin_, at::Tensor& k_cache,
                              at::Tensor& v_cache, const at::Tensor& slot_blocks_, const at::Tensor& slot_offsets_,
                              int64_t num_heads) {
  check_f32(qkv_, "qkv");
  const bool i8 = k_cache.scalar_type() == at::kChar;  // int8 cache: rows of D values + a float32 scale
  if (!i8) check_f32(k_cache, "k_cache");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must have one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  auto qkv = qkv_.contiguous();
  auto cos = cos_.contiguous(), sin = sin_.contiguous();
  auto slot_blocks = as_contiguous(slot_blocks_, at::kLong), slot_offsets = as_contiguous(slot_offsets_, at::kLong);
  const int64_t T = qkv.size(0), hkv = k_cache.size(0), num_blocks = k_cache.size(1), bs = k_cache.size(2),
                RW = k_cache.size(3), D = i8 ? RW - kvferry_cpu::KV_SCALE_BYTES : RW, half = D / 2,
                width = qkv.size(1), heads = num_heads + hkv;
  TORCH_CHECK(width == (num_heads + 2 * hkv) * D, "qkv width does not match the heads");
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D, "cos / sin must be [T, D]");
  const bool norms = q_weight.numel() > 0;
  TORCH_CHECK(norms == (k_weight.numel() > 0), "q_weight and k_weight: both given or both empty");
  TORCH_CHECK(!norms || (q_weight.numel() == D && k_weight.numel() == D), "q/k norm weights must be [D]");
  auto qk = at::empty({T, heads, D}, qkv.options());
  const float *src = qkv.data_ptr<float>(), *qw = norms ? q_weight.data_ptr<float>() : nullptr,
              *kw = norms ? k_weight.data_ptr<float>() : nullptr, *cp = cos.data_ptr<float>(),
              *sp = sin.data_ptr<float>();
  const int64_t *blk = slot_blocks.data_ptr<int64_t>(), *off = slot_offsets.data_ptr<int64_t>();
  float* qkp = qk.data_ptr<float>();
  char *kc = static_cast<char*>(k_cache.data_ptr()), *vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t esize = k_cache.element_size();
  // a K or V row into its cache slot: copied, or quantized into an int8 cache's row
  auto store = [&](const float* row, char* cache, int64_t h, int64_t t) {
    char* dst = cache + (((h * num_blocks + blk[t]) * bs + off[t]) * RW) * esize;
    if (i8)
      kvferry_cpu::quantize_kv_row(row, D, reinterpret_cast<int8_t*>(dst));
    else
      std::copy_n(row, D, reinterpret_cast<float*>(dst));
  };
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> normed(D);
    for (int64_t t = t0; t < t1; ++t) {
      const float *c = cp + t * D, *s = sp + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x = src + t * width + h * D;
        float* n = normed.data();
        if (norms) {
          const float* w = h < num_heads ? qw : kw;
          const float scale = rms_scale(x, D, eps);
          for (int64_t i = 0; i < D; ++i) n[i] = x[i] * scale * w[i];
        } else {
          std::copy_n(x, D, n);
        }
        float* dst = qkp + (t * heads + h) * D;
        // x * cos + roll(x, D/2) * sin (sin's first half negated), as two halves so that both vectorize
        for (int64_t i = 0; i < half; ++i) dst[i] = n[i] * c[i] + n[i + half] * s[i];
        for (int64_t i = half; i < D; ++i) dst[i] = n[i] * c[i] + n[i - half] * s[i];
        if (h >= num_heads) store(dst, kc, h - num_heads, t);
      }
      for (int64_t h = 0; h < hkv; ++h) store(src + t * width + (heads + h) * D, vc, h, t);
    }
  });
  return qk;
}

// int8 cache [Hkv, num_blocks, bs, D + 4] -> float32 [Hkv, len(ids), bs, D]: blocks `ids`, dequantized
at::Tensor dequantize_blocks(const at::Tensor& cache, const std::vector<int64_t>& ids) {
  const int64_t hkv = cache.size(0), num_blocks = cache.size(1), bs = cache.size(2), RW = cache.size(3),
                D = RW - kvferry_cpu::KV_SCALE_BYTES, n = ids.size();
  auto out = at::empty({hkv, n, bs, D}, cache.options().dtype(at::kFloat));
  const int8_t* src = cache.data_ptr<int8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, hkv * n, 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / n, j = i % n;
      TORCH_CHECK(ids[j] >= 0 && ids[j] < num_blocks, "block id out of range");
      const int8_t* block = src + (h * num_blocks + ids[j]) * bs * RW;
      for (int64_t s = 0; s < bs; ++s) kvferry_cpu::dequantize_kv_row(block + s * RW, D, dst + (i * bs + s) * D);
    }
  });
  return out;
}

namespace {

// The int8 cache's blocks a batch's tables use, dequantized once: (the planes as float32, the tables renumbered)
std::tuple<std::vector<int64_t>, at::Tensor> used_blocks(const at::Tensor& block_tables, const at::Tensor& lens,
                                                         int64_t bs) {
  const int64_t B = block_tables.size(0), W = block_tables.size(1);
  std::vector<int64_t> used;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = std::min<int64_t>(W, (lens.data_ptr<int64_t>()[b] + bs - 1) / bs);
    used.insert(used.end(), block_tables.data_ptr<int64_t>() + b * W, block_tables.data_ptr<int64_t>() + b * W + n);
  }
  std::sort(used.begin(), used.end());
  used.erase(std::unique(used.begin(), used.end()), used.end());
  auto tables = at::zeros_like(block_tables);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = std::min<int64_t>(W, (lens.data_ptr<int64_t>()[b] + bs - 1) / bs);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t id = block_tables.data_ptr<int64_t>()[b * W + j];
      tables.data_ptr<int64_t>()[b * W + j] = std::lower_bound(used.begin(), used.end(), id) - used.begin();
    }
  }
  return {used, tables};
}

}  // namespace

// One query token per sequence over its cached KV blocks. q [B, Hq, D]; caches [Hkv, num_blocks, bs, D];
// block_tables [B, W] (int64); context_lens [B]. Returns [B, Hq * D]. Query heads h*G..h*G+G-1 read KV head h.
at::Tensor paged_decode_attention(const at::Tensor& q_, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables_, const at::Tensor& context_lens_, double scale) {
  if (k_cache.scalar_type() == at::kChar) {  // int8 cache: the blocks the tables use, dequantized once
    auto lens = as_contiguous(context_lens_, at::kLong);
    auto [used, tables] = used_blocks(as_contiguous(block_tables_, at::kLong), lens, k_cache.size(2));
    return paged_decode_attention(q_, dequantize_blocks(k_cache, used), dequantize_blocks(v_cache, used), tables,
                                  lens, scale);
  }
  check_f32(q_, "q");
  check_f32(k_cache, "k_cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  auto q = q_.contiguous();
  auto block_tables = as_contiguous(block_tables_, at::kLong);
  auto context_lens = as_contiguous(context_lens_, at::kLong);
  const int64_t B = q.size(0), hq = q.size(1), D = q.size(2), hkv = k_cache.size(0), num_blocks = k_cache.size(1),
                bs = k_cache.size(2), W = block_tables.size(1), group = hq / hkv;
  auto out = at::empty({B, hq * D}, q.options());
  const float *qp = q.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int64_t *bt = block_tables.data_ptr<int64_t>(), *lens = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
#ifdef KVFERRY_AVX512BF16
  const int64_t DV = D / 16;
  if (D % 16 == 0 && (DV == 1 || DV == 2 || DV == 4 || DV == 8) && group <= 128) {
    at::parallel_for(0, B * hkv, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> scores;
      std::vector<int64_t> offsets;
      for (int64_t item = i0; item < i1; ++item) {
        const int64_t b = item / hkv, h = item % hkv, len = std::min(lens[b], W * bs);
        offsets.resize(len);
        for (int64_t t0 = 0, j = 0; t0 < len; t0 += bs, ++j) {
          const int64_t base = (h * num_blocks + bt[b * W + j]) * bs * D;
          for (int64_t t = t0; t < std::min(t0 + bs, len); ++t) offsets[t] = base + (t - t0) * D;
        }
        scores.resize(group * ((len + 15) / 16 * 16));
        const float* qb = qp + (b * hq + h * group) * D;
        float* ob = op + (b * hq + h * group) * D;
        if (len == 0) {
          std::fill(ob, ob + group * D, 0.f);
          continue;
        }
        switch (DV) {
          case 1: attend_avx512<1>(qb, group, kc, vc, offsets.data(), len, fscale, scores.data(), ob); break;
          case 2: attend_avx512<2>(qb, group, kc, vc, offsets.data(), len, fscale, scores.data(), ob); break;
          case 4: attend_avx512<4>(qb, group, kc, vc, offsets.data(), len, fscale, scores.data(), ob); break;
          default: attend_avx512<8>(qb, group, kc, vc, offsets.data(), len, fscale, scores.data(), ob); break;
        }
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, B * hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores, acc(group * D);
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / hkv, h = item % hkv, len = std::min(lens[b], W * bs);
      const float* qb = qp + (b * hq + h * group) * D;
      scores.assign(group * len, 0.f);
      for (int64_t t = 0; t < len;) {
        if (t % bs == 0 && t + bs < len) prefetch_block(kc, vc, (h * num_blocks + bt[b * W + t / bs + 1]) * bs * D, bs * D);
        const float* k = kc + ((h * num_blocks + bt[b * W + t / bs]) * bs + t % bs) * D;
        if (D % 8 == 0 && t % bs + 8 <= bs && t + 8 <= len) {  // 8 rows of one block at once
          for (int64_t g = 0; g < group; ++g) dot8(qb + g * D, k, D, &scores[g * len + t]);
          t += 8;
        } else {
          for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(qb + g * D, k, D);
          t += 1;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      softmax_rows(scores.data(), group, len, fscale);
      for (int64_t t = 0; t < len; ++t) {
        const float* v = vc + ((h * num_blocks + bt[b * W + t / bs]) * bs + t % bs) * D;
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * len + t], v, acc.data() + g * D, D);
      }
      std::copy(acc.begin(), acc.end(), op + (b * hq + h * group) * D);
    }
  });
  return out;
}

namespace {

// 8 values of a row, float32 as is or bfloat16 widened exactly; the last vector of a row: rem values (1..8)
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }

inline __m256 load8(const at::BFloat16* x) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline __m256 load8_tail(const float* x, __m256i mask, int64_t) { return _mm256_maskload_ps(x, mask); }

inline __m256 load8_tail(const at::BFloat16* x, __m256i, int64_t rem) {
  if (rem == 8) return load8(x);
  alignas(16) at::BFloat16 buf[8] = {};
  std::copy(x, x + rem, buf);
  return load8(buf);
}

// y[j : j + 8V] (n: where y ends; the last vector masked) = (add ? y : 0) + the sum over i < m of a[i] *
// row(i)[same] (float32 or bfloat16 rows), each value summed in i order, a fused multiply-add a step, with V
// running sums in registers
template <int V, typename Row>
inline void combine_chunk(const float* a, int64_t m, const Row& row, float* y, int64_t j, int64_t n, bool add) {
  const int64_t rem = std::min<int64_t>(8, n - j - 8 * (V - 1));  // values in the last vector, 1..8
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rem)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256 c[V];
#pragma GCC unroll 8
  for (int v = 0; v < V - 1; ++v) c[v] = add ? _mm256_loadu_ps(y + j + 8 * v) : _mm256_setzero_ps();
  c[V - 1] = add ? _mm256_maskload_ps(y + j + 8 * (V - 1), tail) : _mm256_setzero_ps();
  for (int64_t i = 0; i < m; ++i) {
    const __m256 ai = _mm256_set1_ps(a[i]);
    const auto* x = row(i) + j;
#pragma GCC unroll 8
    for (int v = 0; v < V - 1; ++v) c[v] = _mm256_fmadd_ps(ai, load8(x + 8 * v), c[v]);
    c[V - 1] = _mm256_fmadd_ps(ai, load8_tail(x + 8 * (V - 1), tail, rem), c[V - 1]);
  }
#pragma GCC unroll 8
  for (int v = 0; v < V - 1; ++v) _mm256_storeu_ps(y + j + 8 * v, c[v]);
  _mm256_maskstore_ps(y + j + 8 * (V - 1), tail, c[V - 1]);
}

// y[0:n] = (add ? y : 0) + the sum over i < m of a[i] * row(i)[0:n], each value summed in i order by fused
// multiply-adds (axpy calls, without their store and reload of y per row). Rows split into runs give the same
// bits: the first run with add = false, the others with add = true.
template <typename Row>
void combine(const float* a, int64_t m, const Row& row, float* y, int64_t n, bool add = false) {
  for (int64_t j = 0; j < n; j += 64) {
    switch ((std::min<int64_t>(64, n - j) + 7) / 8) {
      case 1: combine_chunk<1>(a, m, row, y, j, n, add); break;
      case 2: combine_chunk<2>(a, m, row, y, j, n, add); break;
      case 3: combine_chunk<3>(a, m, row, y, j, n, add); break;
      case 4: combine_chunk<4>(a, m, row, y, j, n, add); break;
      case 5: combine_chunk<5>(a, m, row, y, j, n, add); break;
      case 6: combine_chunk<6>(a, m, row, y, j, n, add); break;
      case 7: combine_chunk<7>(a, m, row, y, j, n, add); break;
      default: combine_chunk<8>(a, m, row, y, j, n, add); break;
    }
  }
}

// combine over the rows of a matrix x (row stride ldx)
template <typename T>
inline void combine_rows(const float* a, int64_t m, const T* x, int64_t ldx, float* y, int64_t n) {
  combine(a, m, [=](int64_t i) { return x + i * ldx; }, y, n);
}

// s[0..7] = the scores of 8 heads (queries q, row stride ld: [first half | second half]) against one latent row,
// its halves r0 and r1; 8 accumulator chains at once, one horizontal-sum tree for all 8
inline void latent_scores8(const float* q, int64_t ld, const float* r0, const float* r1, int64_t half, float* s) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int h = 0; h < 8; ++h) acc[h] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= half; d += 8) {
    const __m256 a = _mm256_loadu_ps(r0 + d), b = _mm256_loadu_ps(r1 + d);
#pragma GCC unroll 8
    for (int h = 0; h < 8; ++h) {
      acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * ld + d), a, acc[h]);
      acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * ld + half + d), b, acc[h]);
    }
  }
  _mm256_storeu_ps(s, hsum8(acc));
  for (; d < half; ++d)
    for (int h = 0; h < 8; ++h) s[h] += q[h * ld + d] * r0[d] + q[h * ld + half + d] * r1[d];
}

// The cached latent rows and their layout, for latent_attend_heads
struct LatentRows {
  const float *p0, *p1;     // the two half planes [1, num_blocks, bs, half] (float32)
  const int64_t *bt, *lens;  // block tables [B, W], context lengths [B]
  int64_t W, bs, half, rank, skip;
  float scale;
};

// One work item of the absorbed decode: sequence b's hn heads, queries qb [hn, 2 half] -> ob [hn, rank]. Rows
// are read in runs of ROWS that stay in cache while every head of the item uses them (scores, then the
// weighted sum). Every head's score goes through the 8-head kernel (the last heads padded with zero queries), so
// a head's result does not depend on how heads are grouped (the thread count, the batch).
void latent_attend_heads(const LatentRows& c, int64_t b, const float* qb, int64_t hn, float* ob,
                         std::vector<float>& scores) {
  constexpr int64_t ROWS = 64;
  const int64_t Wl = 2 * c.half, lo = std::min(c.half, c.rank), hi = c.rank - lo;  // V's values in each plane
  const int64_t end = std::min(c.lens[b], c.W * c.bs), len = std::max<int64_t>(end - c.skip, 0);
  if (hn <= 0) return;
  if (len == 0) return std::fill(ob, ob + hn * c.rank, 0.f);
  const int64_t h8 = (hn + 7) / 8 * 8;  // heads rounded up to whole groups of 8
  std::vector<float> padded;
  if (h8 != hn) {  // the queries with zero rows after the last head
    padded.assign(h8 * Wl, 0.f);
    std::copy(qb, qb + hn * Wl, padded.begin());
    qb = padded.data();
  }
  scores.resize(h8 * len);
  std::vector<int64_t> at(len);  // each row's offset in the planes
  for (int64_t i = 0; i < len; ++i) {  // row i: position skip + i
    const int64_t t = c.skip + i;
    at[i] = (c.bt[b * c.W + t / c.bs] * c.bs + t % c.bs) * c.half;
  }
  alignas(32) float s8[8];
  for (int64_t i = 0; i < len; ++i) {
    const float *r0 = c.p0 + at[i], *r1 = c.p1 + at[i];
    for (int64_t h = 0; h < h8; h += 8) {
      latent_scores8(qb + h * Wl, Wl, r0, r1, c.half, s8);
      for (int64_t g = 0; g < 8; ++g) scores[(h + g) * len + i] = s8[g];
    }
  }
  softmax_rows(scores.data(), hn, len, c.scale);
  for (int64_t i0 = 0; i0 < len; i0 += ROWS) {
    const int64_t n = std::min(ROWS, len - i0);
    for (int64_t h = 0; h < hn; ++h) {
      const float* p = scores.data() + h * len + i0;
      combine(p, n, [&](int64_t i) { return c.p0 + at[i0 + i]; }, ob + h * c.rank, lo, i0 > 0);
      if (hi > 0) combine(p, n, [&](int64_t i) { return c.p1 + at[i0 + i]; }, ob + h * c.rank + lo, hi, i0 > 0);
    }
  }
}

// heads per work item: enough items for every thread at batch 1, few enough that a row is reused many times
int64_t latent_head_groups(int64_t B, int64_t H) {
  return std::max<int64_t>(1, std::min<int64_t>(H, (at::get_num_threads() + B - 1) / B));
}

void check_latent_planes(const at::Tensor& first, const at::Tensor& second, int64_t W) {
  const bool i8 = first.scalar_type() == at::kChar;
  const int64_t RW = i8 ? W / 2 + kvferry_cpu::KV_SCALE_BYTES : W / 2;
  TORCH_CHECK(W % 2 == 0 && first.size(-1) == RW && first.is_contiguous() && second.is_contiguous() &&
                  first.sizes() == second.sizes() && first.scalar_type() == second.scalar_type(),
              "latent planes [1, blocks, bs, (rank + rope) / 2]");
  TORCH_CHECK(i8 || first.scalar_type() == at::kFloat, "the latent cache must be float32 or int8");
}

// The latent planes a decode reads, float32: the planes themselves, or (int8 rows) the blocks the tables use,
// dequantized once, with the tables renumbered to them. `keep` holds the tensors the view points into.
LatentRows latent_rows_of(const at::Tensor& first, const at::Tensor& second, const at::Tensor& tables,
                          const at::Tensor& lens, int64_t rank, int64_t skip, double scale,
                          std::vector<at::Tensor>& keep) {
  keep = {first, second, tables};
  if (first.scalar_type() == at::kChar) {
    auto [used, renumbered] = used_blocks(tables, lens, first.size(2));
    keep = {dequantize_blocks(first, used), dequantize_blocks(second, used), renumbered};
  }
  check_f32(keep[0], "first");
  check_f32(keep[1], "second");
  return {keep[0].data_ptr<float>(), keep[1].data_ptr<float>(), keep[2].data_ptr<int64_t>(),
          lens.data_ptr<int64_t>(),  keep[2].size(1),           keep[0].size(2),
          keep[0].size(3),           rank,                       skip,
          static_cast<float>(scale)};
}

}  // namespace

// MLA's absorbed decode: one query token per sequence over its cached latent rows. q [B, H, Wl] (Wl = the
// latent's width, rank + rope: the query folded into the latent space, then its rope part); the cache's two
// half planes [1, num_blocks, bs, Wl/2] (float32, or int8 rows with scales: the blocks used are dequantized
// once); block_tables [B, W]; context_lens [B]. Returns [B, H, rank]: softmax(scale q.row) applied to each
// row's first `rank` values; the first `skip` positions are not attended (the MTP layer's slot 0 holds no
// entry). Each row is read from memory once per (sequence, group of heads) and used by
// every head of the group while it is in cache; work items are (sequence, group of heads).
at::Tensor latent_decode_attention(const at::Tensor& q_, const at::Tensor& first, const at::Tensor& second,
                                   const at::Tensor& block_tables_, const at::Tensor& context_lens_, double scale,
                                   int64_t rank, int64_t skip) {
  check_f32(q_, "q");
  auto q = q_.contiguous();
  auto block_tables = as_contiguous(block_tables_, at::kLong), lens = as_contiguous(context_lens_, at::kLong);
  const int64_t B = q.size(0), H = q.size(1), Wl = q.size(2);
  check_latent_planes(first, second, Wl);
  TORCH_CHECK(first.size(0) == 1 && rank > 0 && rank <= Wl && skip >= 0, "q [B, H, 2 * half], rank <= width");
  std::vector<at::Tensor> keep;
  const LatentRows rows = latent_rows_of(first, second, block_tables, lens, rank, skip, scale, keep);
  auto out = at::empty({B, H, rank}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t groups = latent_head_groups(B, H), per = (H + groups - 1) / groups;
  at::parallel_for(0, B * groups, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores;
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / groups, h0 = (item % groups) * per, hn = std::min(per, H - h0);
      latent_attend_heads(rows, b, qp + (b * H + h0) * Wl, hn, op + (b * H + h0) * rank, scores);
    }
  });
  return out;
}

// MLA's rotation and cache write in one pass. q [T, H, nope + rope]; latent [T, rank + rope] (kv_a's output: the
// rope part not yet rotated); c [T, rank] (the normalised latent); cos / sin_signed [T, rope]. Writes each token's
// row [c | rotated k_rope] into its slot of the two half planes [1, blocks, bs, W/2] (float32, or int8 rows with
// their scale). Returns (q with its rope part rotated, the rows [T, W]). Rotation: x * cos + roll(x, rope/2) * sin,
// model/layers.py's apply_rotary.
namespace {

// latent_rope_store on raw rows: q [T, H, nope + rope]; latent [T, rank + rope]; c [T, rank]; cos / sin [T, rope];
// the two planes' data (float32 or int8 rows of RW bytes' worth), num_blocks x bs slots each; slot blocks and
// offsets [T]. Writes the rotated q into q_out [T, H, nope + rope] and the rows into rows [T, rank + rope].
void latent_rope_store_rows(const float* qp, const float* lp, const float* cp, const float* cosp, const float* sinp,
                            int64_t T, int64_t H, int64_t qk, int64_t rank, int64_t rope, void* first, void* second,
                            bool i8, int64_t num_blocks, int64_t bs, const int64_t* bp, const int64_t* fp, float* op,
                            float* rp) {
  const int64_t nope = qk - rope, W = rank + rope, half = W / 2;
  const int64_t RW = i8 ? half + kvferry_cpu::KV_SCALE_BYTES : half;
  auto rotate = [&](const float* x, const float* cos, const float* sin, float* y) {
    for (int64_t i = 0; i < rope; ++i) y[i] = x[i] * cos[i] + x[(i + rope / 2) % rope] * sin[i];
  };
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *cos = cosp + t * rope, *sin = sinp + t * rope;
      for (int64_t h = 0; h < H; ++h) {
        const float* src = qp + (t * H + h) * qk;
        float* dst = op + (t * H + h) * qk;
        std::copy(src, src + nope, dst);
        rotate(src + nope, cos, sin, dst + nope);
      }
      float* row = rp + t * W;
      std::copy(cp + t * rank, cp + (t + 1) * rank, row);
      rotate(lp + t * W + rank, cos, sin, row + rank);
      TORCH_CHECK(bp[t] >= 0 && bp[t] < num_blocks && fp[t] >= 0 && fp[t] < bs, "slot out of range");
      const int64_t slot = (bp[t] * bs + fp[t]) * RW;
      if (i8) {
        kvferry_cpu::quantize_kv_row(row, half, static_cast<int8_t*>(first) + slot);
        kvferry_cpu::quantize_kv_row(row + half, half, static_cast<int8_t*>(second) + slot);
      } else {
        std::copy(row, row + half, static_cast<float*>(first) + slot);
        std::copy(row + half, row + W, static_cast<float*>(second) + slot);
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> latent_rope_store(const at::Tensor& q_, const at::Tensor& latent_,
                                                     const at::Tensor& c_, const at::Tensor& cos_,
                                                     const at::Tensor& sin_, at::Tensor& first, at::Tensor& second,
                                                     const at::Tensor& slot_blocks_, const at::Tensor& slot_offsets_) {
  check_f32(q_, "q");
  auto q = q_.contiguous(), latent = latent_.contiguous(), c = c_.contiguous();
  auto cs = as_contiguous(cos_, at::kFloat), sn = as_contiguous(sin_, at::kFloat);
  auto blocks = as_contiguous(slot_blocks_, at::kLong), offsets = as_contiguous(slot_offsets_, at::kLong);
  const int64_t T = q.size(0), H = q.size(1), qk = q.size(2), rank = c.size(1), rope = cs.size(1), W = rank + rope;
  TORCH_CHECK(latent.size(1) == W, "latent_rope_store shapes");
  check_latent_planes(first, second, W);
  auto out = at::empty_like(q);
  auto rows = at::empty({T, W}, q.options());
  latent_rope_store_rows(q.data_ptr<float>(), latent.data_ptr<float>(), c.data_ptr<float>(), cs.data_ptr<float>(),
                         sn.data_ptr<float>(), T, H, qk, rank, rope, first.data_ptr(), second.data_ptr(),
                         first.scalar_type() == at::kChar, first.size(1), first.size(2),
                         blocks.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), out.data_ptr<float>(),
                         rows.data_ptr<float>());
  return {out, rows};
}

namespace {

// DeepSeek-V3's noaux_tc choice for rows [t0, t1) of router logits lp [T, E]: sigmoid scores; scores + bias choose
// the topk_group groups (of n_group) whose two best experts score highest, then the top_k experts in them; weights
// are the chosen experts' scores, renormalised (sum + 1e-20) if asked, times `scaling` (model/moe.py's
// grouped_route). Writes weights wp [T, k] and ids ip [T, k], experts in descending choice order; serial.
void grouped_topk_rows(const float* lp, int64_t t0, int64_t t1, int64_t E, const float* bp, int64_t top_k,
                       bool renormalize, int64_t n_group, int64_t topk_group, double scaling, float* wp, int64_t* ip) {
  const int64_t per = E / n_group;
  std::vector<float> score(E), choice(E);
  std::vector<int64_t> order(std::max(E, n_group));
  std::vector<float> group_best(n_group);
  std::vector<char> allowed(n_group);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t e = 0; e < E; ++e) {
      score[e] = 1.f / (1.f + std::exp(-lp[t * E + e]));
      choice[e] = score[e] + bp[e];
    }
    std::fill(allowed.begin(), allowed.end(), 1);
    if (topk_group < n_group) {
      for (int64_t g = 0; g < n_group; ++g) {
        const float* v = choice.data() + g * per;
        float a = -INFINITY, b = -INFINITY;
        for (int64_t i = 0; i < per; ++i) {
          if (v[i] > a) {
            b = a;
            a = v[i];
          } else if (v[i] > b) {
            b = v[i];
          }
        }
        group_best[g] = a + b;
      }
      std::iota(order.begin(), order.begin() + n_group, 0);
      std::partial_sort(order.begin(), order.begin() + topk_group, order.begin() + n_group,
                        [&](int64_t a, int64_t b) { return group_best[a] > group_best[b]; });
      std::fill(allowed.begin(), allowed.end(), 0);
      for (int64_t i = 0; i < topk_group; ++i) allowed[order[i]] = 1;
    }
    int64_t n = 0;
    for (int64_t e = 0; e < E; ++e)
      if (allowed[e / per]) order[n++] = e;
    std::partial_sort(order.begin(), order.begin() + top_k, order.begin() + n,
                      [&](int64_t a, int64_t b) { return choice[a] > choice[b]; });
    float sum = 0.f;
    for (int64_t j = 0; j < top_k; ++j) sum += score[order[j]];
    const float norm = renormalize ? sum + 1e-20f : 1.f;
    for (int64_t j = 0; j < top_k; ++j) {
      ip[t * top_k + j] = order[j];
      wp[t * top_k + j] = score[order[j]] / norm * static_cast<float>(scaling);
    }
  }
}

void check_grouping(int64_t E, int64_t top_k, int64_t n_group, int64_t topk_group, int64_t bias_numel) {
  TORCH_CHECK(n_group > 0 && E % n_group == 0 && topk_group > 0 && topk_group <= n_group, "n_group / topk_group");
  const int64_t per = E / n_group;
  TORCH_CHECK(per >= (topk_group < n_group ? 2 : 1) && top_k > 0 && top_k <= per * topk_group && bias_numel == E,
              "grouped_topk shapes");
}

// router logits out [T, E] = x [T, H] @ router [H, E] (float32, input-major, not packed) for rows [t0, t1);
// serial. Each logit is one fused multiply-add chain over k in order, whichever rows and threads.
void router_logits_rows(const float* x, int64_t t0, int64_t t1, int64_t H, const float* r, int64_t E, float* out) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* xr = x + t * H;
    float* o = out + t * E;
    int64_t c = 0;
    for (; c + 32 <= E; c += 32) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t k = 0; k < H; ++k) {
        const __m256 xv = _mm256_set1_ps(xr[k]);
        const float* w = r + k * E + c;
        a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w), a0);
        a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 8), a1);
        a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 16), a2);
        a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + 24), a3);
      }
      _mm256_storeu_ps(o + c, a0);
      _mm256_storeu_ps(o + c + 8, a1);
      _mm256_storeu_ps(o + c + 16, a2);
      _mm256_storeu_ps(o + c + 24, a3);
    }
    for (; c + 8 <= E; c += 8) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t k = 0; k < H; ++k) a = _mm256_fmadd_ps(_mm256_set1_ps(xr[k]), _mm256_loadu_ps(r + k * E + c), a);
      _mm256_storeu_ps(o + c, a);
    }
    for (; c < E; ++c) {
      float a = 0.f;
      for (int64_t k = 0; k < H; ++k) a = std::fma(xr[k], r[k * E + c], a);
      o[c] = a;
    }
  }
}

}  // namespace

// DeepSeek-V3's noaux_tc routing over router logits [T, E] (float32): grouped_topk_rows for every row. Returns
// (weights [T, k] float32, ids [T, k] int64), experts in descending choice order.
std::tuple<at::Tensor, at::Tensor> grouped_topk(const at::Tensor& logits_, const at::Tensor& bias_, int64_t top_k,
                                                bool renormalize, int64_t n_group, int64_t topk_group,
                                                double scaling) {
  auto logits = as_contiguous(logits_, at::kFloat);
  auto bias = as_contiguous(bias_, at::kFloat);
  const int64_t T = logits.size(0), E = logits.size(1);
  check_grouping(E, top_k, n_group, topk_group, bias.numel());
  auto weights = at::empty({T, top_k}, logits.options());
  auto ids = at::empty({T, top_k}, logits.options().dtype(at::kLong));
  const float *lp = logits.data_ptr<float>(), *bp = bias.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    grouped_topk_rows(lp, t0, t1, E, bp, top_k, renormalize, n_group, topk_group, scaling, wp, ip);
  });
  return {weights, ids};
}

// The whole noaux_tc route of x [T, H] (float32): router logits x @ router [H, E] (float32; router_logits_rows),
// then grouped_topk. What the decode step's kernel runs, so the layer-by-layer forward calls it too.
std::tuple<at::Tensor, at::Tensor> grouped_route(const at::Tensor& x_, const at::Tensor& router_, const at::Tensor& bias,
                                                 int64_t top_k, bool renormalize, int64_t n_group, int64_t topk_group,
                                                 double scaling) {
  check_f32(x_, "x");
  check_f32(router_, "router");
  auto x = x_.contiguous(), router = router_.contiguous();
  TORCH_CHECK(x.dim() == 2 && router.dim() == 2 && router.size(0) == x.size(1), "x [T, H], router [H, E]");
  const int64_t T = x.size(0), H = x.size(1), E = router.size(1);
  auto logits = at::empty({T, E}, x.options());
  const float *xp = x.data_ptr<float>(), *rp = router.data_ptr<float>();
  float* lp = logits.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) { router_logits_rows(xp, t0, t1, H, rp, E, lp); });
  return grouped_topk(logits, bias, top_k, renormalize, n_group, topk_group, scaling);
}

namespace {

// MLA's absorbed up-projections, W_uk [H, nope, rank] and W_uv [H, rank, v]: both float32, or both bfloat16 (a
// bf16 checkpoint's values, which the kernels widen exactly: the same products at half the bytes)
struct Absorbed {
  const void *uk, *uv;
  bool bf16;
};

Absorbed absorbed_of(const at::Tensor& uk, const at::Tensor& uv, int64_t H, int64_t nope, int64_t rank, int64_t vd) {
  const auto type = uk.scalar_type();
  TORCH_CHECK((type == at::kFloat || type == at::kBFloat16) && uv.scalar_type() == type,
              "W_uk / W_uv: both float32 or both bfloat16");
  TORCH_CHECK(uk.device().is_cpu() && uv.device().is_cpu(), "W_uk / W_uv: CPU tensors");
  TORCH_CHECK(uk.is_contiguous() && uv.is_contiguous() && uk.numel() == H * nope * rank && uv.numel() == H * rank * vd,
              "W_uk / W_uv shapes");
  return {uk.data_ptr(), uv.data_ptr(), type == at::kBFloat16};
}

// one work item of latent_decode_rows: sequence item / groups, its (item % groups)-th group of `per` heads
template <typename T>
void latent_decode_item(const float* qp, int64_t H, int64_t qk, int64_t nope, int64_t vd, const T* uk, const T* uv,
                        const LatentRows& rows, int64_t item, int64_t groups, int64_t per, std::vector<float>& query,
                        std::vector<float>& attn, std::vector<float>& scores, float* op) {
  const int64_t rank = rows.rank, Wl = 2 * rows.half;
  const int64_t b = item / groups, h0 = (item % groups) * per, hn = std::min(per, H - h0);
  for (int64_t h = h0; h < h0 + hn; ++h) {  // the query in the latent space: [q_nope W_uk | q_rope]
    const float* src = qp + (b * H + h) * qk;
    float* dst = query.data() + (h - h0) * Wl;
    combine_rows(src, nope, uk + h * nope * rank, rank, dst, rank);
    std::copy(src + nope, src + qk, dst + rank);
  }
  latent_attend_heads(rows, b, query.data(), hn, attn.data(), scores);
  for (int64_t h = h0; h < h0 + hn; ++h)
    combine_rows(attn.data() + (h - h0) * rank, rank, uv + h * rank * vd, vd, op + (b * H + h) * vd, vd);
}

void latent_decode_item(const float* qp, int64_t H, int64_t qk, int64_t nope, int64_t vd, const Absorbed& w,
                        const LatentRows& rows, int64_t item, int64_t groups, int64_t per, std::vector<float>& query,
                        std::vector<float>& attn, std::vector<float>& scores, float* op) {
  if (w.bf16)
    latent_decode_item(qp, H, qk, nope, vd, static_cast<const at::BFloat16*>(w.uk),
                       static_cast<const at::BFloat16*>(w.uv), rows, item, groups, per, query, attn, scores, op);
  else
    latent_decode_item(qp, H, qk, nope, vd, static_cast<const float*>(w.uk), static_cast<const float*>(w.uv), rows,
                       item, groups, per, query, attn, scores, op);
}

// latent_decode on raw rows: q [T, H, qk] (rope part rotated), W_uk / W_uv, float32 latent rows -> out [T, H, vd]
void latent_decode_rows(const float* qp, int64_t T, int64_t H, int64_t qk, int64_t nope, int64_t vd, const Absorbed& w,
                        const LatentRows& rows, float* op) {
  const int64_t rank = rows.rank, Wl = 2 * rows.half;
  const int64_t groups = latent_head_groups(T, H), per = (H + groups - 1) / groups;
  at::parallel_for(0, T * groups, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores, query(per * Wl), attn(per * rank);
    for (int64_t item = i0; item < i1; ++item)
      latent_decode_item(qp, H, qk, nope, vd, w, rows, item, groups, per, query, attn, scores, op);
  });
}

}  // namespace

// MLA's absorbed decode, whole: q [T, H, nope + rope] (rope part rotated) -> [T, H, v]. Each head's q_nope is
// folded through W_uk [H, nope, rank] into the latent space, attends over the cached rows (as
// latent_decode_attention), and its result goes through W_uv [H, rank, v]. One parallel region: a work item
// (a sequence's group of heads) runs all three for its heads; the small per-head products are row sums with
// their running sums in registers (no batched GEMM calls for a handful of rows).
at::Tensor latent_decode(const at::Tensor& q_, const at::Tensor& w_uk_, const at::Tensor& w_uv_, const at::Tensor& first,
                         const at::Tensor& second, const at::Tensor& block_tables_, const at::Tensor& context_lens_,
                         double scale, int64_t skip) {
  check_f32(q_, "q");
  auto q = q_.contiguous(), w_uk = w_uk_.contiguous(), w_uv = w_uv_.contiguous();
  auto block_tables = as_contiguous(block_tables_, at::kLong), lens = as_contiguous(context_lens_, at::kLong);
  const int64_t T = q.size(0), H = q.size(1), qk = q.size(2), nope = w_uk.size(1), rank = w_uk.size(2),
                rope = qk - nope, vd = w_uv.size(2);
  TORCH_CHECK(w_uk.size(0) == H && w_uv.size(0) == H && w_uv.size(1) == rank && rope > 0, "W_uk / W_uv shapes");
  check_latent_planes(first, second, rank + rope);
  TORCH_CHECK(first.size(0) == 1 && skip >= 0, "latent planes [1, blocks, bs, (rank + rope) / 2]");
  std::vector<at::Tensor> keep;
  const LatentRows rows = latent_rows_of(first, second, block_tables, lens, rank, skip, scale, keep);
  auto out = at::empty({T, H, vd}, q.options());
  latent_decode_rows(q.data_ptr<float>(), T, H, qk, nope, vd, absorbed_of(w_uk, w_uv, H, nope, rank, vd), rows,
                     out.data_ptr<float>());
  return out;
}

namespace {

// A GEMM phase's work split by cost: GEMM i's size(i) = (rows, column blocks) makes that many units, each
// costing its rows plus ROW_COST_OF_BLOCK (reading its weights). fn(i, b0, b1) for each GEMM's run of units
// whose cost starts in [lo, hi), in GEMM order: a thread takes one contiguous run and reads each weight front
// to back (what the hardware prefetchers follow); every output column is computed the same way whoever does.
constexpr int64_t ROW_COST_OF_BLOCK = 8;

template <typename Size>
int64_t units_cost(int64_t n, Size&& size) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto [rows, blocks] = size(i);
    total += (rows + ROW_COST_OF_BLOCK) * blocks;
  }
  return total;
}

template <typename Size, typename Fn>
void units_in(int64_t n, Size&& size, int64_t lo, int64_t hi, Fn&& fn) {
  int64_t before = 0;
  for (int64_t i = 0; i < n && before < hi; ++i) {
    const auto [rows, blocks] = size(i);
    const int64_t unit = rows + ROW_COST_OF_BLOCK, end = before + unit * blocks;
    if (end > lo) {  // units b with lo <= before + b * unit < hi
      const int64_t b0 = std::max<int64_t>(0, (lo - before + unit - 1) / unit);
      const int64_t b1 = std::min<int64_t>(blocks, (hi - before + unit - 1) / unit);
      if (b0 < b1) fn(i, b0, b1);
    }
    before = end;
  }
}

// token t's output o [H]: its local routed terms (row_of >= 0) weighted and added in expert order (model/moe.py's
// sum; zeros where it has none), then its shared experts' row ys[t] (null: none), as the layer-by-layer
// forward's in-place add. terms: scratch.
void combine_token(int64_t t, int64_t top_k, const int64_t* ids, const float* wts, const int64_t* row_of,
                   const float* y, const float* ys, int64_t H, float* o,
                   std::vector<std::pair<int64_t, int64_t>>& terms) {
  terms.clear();  // (expert, assignment)
  for (int64_t a = t * top_k; a < (t + 1) * top_k; ++a)
    if (row_of[a] >= 0) terms.emplace_back(ids[a], a);
  std::sort(terms.begin(), terms.end());
  if (terms.empty()) std::fill_n(o, H, 0.f);
  for (size_t i = 0; i < terms.size(); ++i) {
    const int64_t a = terms[i].second;
    (i ? axpy : axpy_to_zero)(wts[a], y + row_of[a] * H, o, H);
  }
  if (ys)
    for (int64_t i = 0; i < H; ++i) o[i] += ys[t * H + i];
}

}  // namespace

// The experts of an MoE layer for the (token, expert) assignments that fall on experts first..first+E-1.
// x [T, H]; ids, weights [T, k]; w13 packed per expert [E, 2I/16, H, 16] (or bf16 pairs [E, 2I/16, H/2, 32]);
// w2 [E, H/16, I, 16] (or [E, H/16, I/2, 32]). Returns [T, H] = sum over local assignments of
// weight * (silu(x W_gate) * (x W_up)) W_2, each token's terms added in expert order.
// Five parallel regions for the whole layer, whatever the number of experts hit: gather (and round to
// bf16) the rows of every expert; gate/up GEMMs of all experts (each thread one run of (expert, column
// block) units); SiLU*up; down GEMMs likewise; the weighted sum per token. A parallel region costs a thread
// wake-up each (tens of microseconds when threads sleep between regions), so a layer must not pay four per
// expert.
at::Tensor moe_chunk(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, const at::Tensor& w13,
                     const at::Tensor& w2, int64_t first_expert) {
  // the pairs layout is only made for even K and int8 for K a multiple of 4, so K == Kp here
  const bool pairs = is_bf16_pairs(w2), i8 = is_int8(w2);
  const int64_t T = x.size(0), H = x.size(1), top_k = ids.size(1), E = w13.size(0), I = packed_k(w2);
  const int64_t *idp = ids.data_ptr<int64_t>();
  // local assignments grouped by expert, in assignment order: expert e owns rows start[e]..start[e+1)
  std::vector<int64_t> start(E + 1, 0), row_of(T * top_k, -1);
  for (int64_t a = 0; a < T * top_k; ++a) {
    const int64_t e = idp[a] - first_expert;
    if (e >= 0 && e < E) ++start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  const int64_t total = start[E];
  if (total == 0) return at::zeros({T, H}, x.options());
  auto out = at::empty({T, H}, x.options());  // every row written below (zeros where no local expert)
  std::vector<int64_t> token_of(total), fill(start.begin(), start.end() - 1), active;
  for (int64_t a = 0; a < T * top_k; ++a) {
    const int64_t e = idp[a] - first_expert;
    if (e >= 0 && e < E) {
      row_of[a] = fill[e]++;
      token_of[row_of[a]] = a / top_k;
    }
  }
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  const int64_t nact = active.size();
  auto opts = x.options();
  // gathered rows: float32, or their bf16 copies for pair-packed weights, or their int8 rows and scales
  // (the bf16 and int8 rows with the slack the brgemm path reads past an expert's last row)
  int64_t widest = 0;
  for (int64_t e : active) widest = std::max(widest, start[e + 1] - start[e]);
  const int64_t padded = total + kvferry_cpu::brgemm_slack(widest);
  std::vector<float> xs(pairs || i8 ? 0 : total * H), xsc(i8 ? total : 0), hsc(i8 ? total : 0);
  std::vector<uint16_t> xb(pairs ? padded * H : 0), hb(pairs ? padded * I : 0);
  std::vector<kvferry_cpu::act_t> xq(i8 ? padded * H : 0), hq(i8 ? padded * I : 0);
  auto h13 = at::empty({total, 2 * I}, opts), y = at::empty({total, H}, opts);
  const float* xp = x.data_ptr<float>();
  float *xsp = xs.data(), *hp = h13.data_ptr<float>(), *yp = y.data_ptr<float>(), *op = out.data_ptr<float>();

  // column blocks [b0, b1) of expert e's GEMM over its rows start[e]..
  auto expert_gemm = [&](const at::Tensor& w, int64_t e, const Rows& in, int64_t K, int64_t N, float* dst, int64_t b0,
                         int64_t b1) {
    const int64_t r0 = start[e];
    gemm_blocks(Packed(w, e), in.offset(r0, K), start[e + 1] - r0, K, N, dst + r0 * N, N, b0, b1);
  };
  // each thread one run of (expert, column block) units in expert order, of equal cost (units_in)
  auto over_experts = [&](int64_t N, auto&& fn) {
    const int64_t nblocks = (N + NB - 1) / NB;
    auto size = [&](int64_t i) { return std::pair{start[active[i] + 1] - start[active[i]], nblocks}; };
    const int64_t total_cost = units_cost(nact, size);
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nact * nblocks));
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t part = p0; part < p1; ++part)
        units_in(nact, size, total_cost * part / parts, total_cost * (part + 1) / parts,
                 [&](int64_t i, int64_t b0, int64_t b1) { fn(active[i], b0, b1); });
    });
  };
  // int8: a token's row is quantized once, into its first local assignment's row (the scale is per row,
  // whatever the expert), and copied as bytes to its others
  if (i8) {
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        int64_t first = -1;
        for (int64_t j = 0; j < top_k; ++j) {
          const int64_t r = row_of[t * top_k + j];
          if (r < 0) continue;
          if (first < 0) {
            xsc[r] = kvferry_cpu::quantize_row(xp + t * H, H, xq.data() + r * H);
            first = r;
          } else {
            std::copy_n(xq.data() + first * H, H, xq.data() + r * H);
            xsc[r] = xsc[first];
          }
        }
      }
    });
  } else {
    at::parallel_for(0, total, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
#ifdef KVFERRY_AVX512BF16
        if (pairs) {
          row_to_bf16(xp + token_of[r] * H, H, xb.data() + r * H, H);
          continue;
        }
#endif
        std::copy_n(xp + token_of[r] * H, H, xsp + r * H);
      }
    });
  }
  over_experts(2 * I, [&](int64_t e, int64_t b0, int64_t b1) {
    expert_gemm(w13, e, Rows{xsp, H, xb.data(), xq.data(), xsc.data(), padded > total}, H, 2 * I, hp, b0, b1);
  });
  at::parallel_for(0, total, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      silu_mul(hp + r * 2 * I, I);
#ifdef KVFERRY_AVX512BF16
      if (pairs) row_to_bf16(hp + r * 2 * I, I, hb.data() + r * I, I);
#endif
      if (i8) hsc[r] = kvferry_cpu::quantize_row(hp + r * 2 * I, I, hq.data() + r * I);
    }
  });
  // the down projection reads the SiLU*up half of h13 in place (row stride 2I), or its bf16 / int8 copy
  over_experts(H, [&](int64_t e, int64_t b0, int64_t b1) {
    expert_gemm(w2, e, Rows{hp, 2 * I, hb.data(), hq.data(), hsc.data(), padded > total}, I, H, yp, b0, b1);
  });
  const float* wtp = weights.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<std::pair<int64_t, int64_t>> terms;
    for (int64_t t = t0; t < t1; ++t)
      combine_token(t, top_k, idp, wtp, row_of.data(), yp, nullptr, H, op + t * H, terms);
  });
  return out;
}

// Tokens go through moe_chunk in chunks, so that the per-row buffers (gathered rows, gate/up, down) stay a
// few MB and cache-resident however long the prefill step; every token's result is the same either way.
at::Tensor moe_experts(const at::Tensor& x_, const at::Tensor& ids_, const at::Tensor& weights_,
                       const at::Tensor& w13, const at::Tensor& w2, int64_t first_expert) {
  constexpr int64_t CHUNK = 512;  // tokens
  check_f32(x_, "x");
  auto x = x_.contiguous();
  auto ids = as_contiguous(ids_, at::kLong);
  auto weights = as_contiguous(weights_, at::kFloat);
  const int64_t T = x.size(0);
  if (T <= CHUNK) return moe_chunk(x, ids, weights, w13, w2, first_expert);
  auto out = at::empty_like(x);
  for (int64_t t0 = 0; t0 < T; t0 += CHUNK) {
    const int64_t n = std::min(CHUNK, T - t0);
    out.narrow(0, t0, n).copy_(
        moe_chunk(x.narrow(0, t0, n), ids.narrow(0, t0, n), weights.narrow(0, t0, n), w13, w2, first_expert));
  }
  return out;
}

// A dense gated MLP: x [T, H] (float32) @ packed w13 [gate | up] -> silu(gate) * up (silu_mul, the experts'
// own) @ packed w2 -> [T, H]. The dense layers and DeepSeek's shared experts, in every path that runs kernels.
at::Tensor gated_mlp(const at::Tensor& x_, const at::Tensor& w13, const at::Tensor& w2) {
  check_f32(x_, "x");
  auto x = x_.contiguous();
  TORCH_CHECK(x.dim() == 2, "x [T, H]");
  const int64_t T = x.size(0), H = x.size(1), I = packed_k(w2);
  check_packed(w13, H, 2 * I);
  check_packed(w2, I, H);
  auto h13 = at::empty({T, 2 * I}, x.options()), out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  float *hp = h13.data_ptr<float>(), *op = out.data_ptr<float>();
  gemm(x.data_ptr<float>(), H, T, H, w13, 2 * I, hp, 2 * I);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) silu_mul(hp + t * 2 * I, I);
  });
  gemm(hp, 2 * I, T, I, w2, H, op, H);  // the SiLU*up half, in place (row stride 2I)
  return out;
}

// A whole decode step's decoder layers and final norm in one call (every token a decode, one rank, no
// expert parallelism): the same kernels and ATen ops, in the same order, as the model's Python forward
// with kernels on, without a Python round trip between them. x [T, H] is the embedded tokens; weights
// holds 9 tensors per layer: input norm, packed qkv, q norm, k norm (both empty: none), packed o, post-attention norm,
// router [H, E] (empty for a dense MLP layer), packed w13, packed w2. kv_cache [L, 2, Hkv, blocks, bs, D];
// cos / sin [T, D]. Returns the final hidden states [T, H].
at::Tensor decode_layers(const at::Tensor& x_, at::TensorList weights, at::Tensor& kv_cache, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                         const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& final_norm,
                         int64_t num_heads, double eps, double scale, int64_t top_k, bool renormalize) {
  constexpr int64_t PER_LAYER = 9;
  const int64_t L = kv_cache.size(0), H = x_.size(1), hkv = kv_cache.size(2),
                D = kv_cache.size(-1) - (kv_cache.scalar_type() == at::kChar ? kvferry_cpu::KV_SCALE_BYTES : 0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * PER_LAYER, "decode_layers: 9 weights per layer");
  at::Tensor x = x_, residual;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * PER_LAYER;
    at::Tensor k_cache = kv_cache[l][0], v_cache = kv_cache[l][1];
    at::Tensor h;
    if (l == 0) {
      residual = x;
      h = rms_norm(x, w[0], eps);
    } else {
      h = add_rms_norm(x, residual, w[0], eps);
    }
    auto qkv = packed_linear(h, w[1], (num_heads + 2 * hkv) * D);
    auto qk = qk_norm_rope_store(qkv, w[2], w[3], eps, cos, sin, k_cache, v_cache, slot_blocks, slot_offsets,
                                 num_heads);
    auto attn = paged_decode_attention(qk.narrow(1, 0, num_heads), k_cache, v_cache, block_tables, context_lens, scale);
    h = add_rms_norm(packed_linear(attn, w[4], H), residual, w[5], eps);
    if (w[6].numel() > 0) {  // MoE: softmax router, top-k, optional renormalisation (model/moe.py's route)
      auto probs = at::softmax(at::mm(h, w[6]), -1, at::kFloat);
      auto [top, ids] = at::topk(probs, top_k, -1);
      if (renormalize) top = top / top.sum(-1, true);
      x = moe_experts(h, ids, top.to(h.scalar_type()), w[7], w[8], 0);
    } else {  // dense MLP
      x = gated_mlp(h, w[7], w[8]);
    }
  }
  return add_rms_norm(x, residual, final_norm, eps);
}


namespace {

// The threads of one parallel region, meeting at barriers between the phases of a decode step. A parallel
// region is a fork and a join (1-2 us each on a 2-core VM while the threads spin, 5-13 us after a pause of a
// few hundred us) and the layer-by-layer step opened about fifteen a layer; a barrier here costs ~0.25 us.
// A member that waits spins a while, then yields its core between looks, then sleeps on a futex: a peer
// whose core another process holds gets it back (OMP_WAIT_POLICY=PASSIVE, the shared placement's, spins
// least). An exception in a member (a failed allocation, oneDNN's microkernel) fails the team: the others
// leave at their next barrier, and run_team rethrows it after the region.
struct Team {
  std::atomic<int32_t> count{0}, generation{0}, sleepers{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // the first member's exception (written by the member that set `failed`)
};

struct TeamFailed {};  // how the other members leave a failed team

// how long a member waits at a barrier before it sleeps: longer than any phase of a step lasts, so that a
// step's members never pay a futex wake-up (tens of microseconds on a VM) while both have their cores; the
// first part spinning, the rest yielding between looks
struct BarrierWait {
  std::chrono::nanoseconds spin, total;
};

inline BarrierWait barrier_wait() {
  static const BarrierWait wait = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    const bool passive = policy && (std::string(policy) == "PASSIVE" || std::string(policy) == "passive");
    using ns = std::chrono::nanoseconds;
    return passive ? BarrierWait{ns(5'000), ns(20'000)} : BarrierWait{ns(100'000), ns(500'000)};
  }();
  return wait;
}

inline void futex(std::atomic<int32_t>& word, int op, int32_t value) {
  syscall(SYS_futex, reinterpret_cast<int32_t*>(&word), op, value, nullptr, nullptr, 0);
}

// a fault for tests (set_team_fault): member m throws at its sync number s (m * 1024 + s; -1: none), once
std::atomic<int64_t>& team_fault() {
  static std::atomic<int64_t> fault{-1};
  return fault;
}

struct Member {
  Team* team;
  int64_t tid, nt, syncs = 0;
  void sync() {  // wait until every member has finished the phase
    const int64_t fault = tid * 1024 + syncs++;
    if (team_fault().load(std::memory_order_relaxed) == fault && team_fault().exchange(-1) == fault)
      throw std::runtime_error("kvferry_cpu: the team fault set by set_team_fault");
    if (nt == 1) return;
    const int32_t gen = team->generation.load(std::memory_order_acquire);
    if (team->count.fetch_add(1, std::memory_order_acq_rel) == nt - 1) {  // the last one in lets the others go
      team->count.store(0, std::memory_order_relaxed);
      team->generation.store(gen + 1, std::memory_order_seq_cst);
      if (team->sleepers.load(std::memory_order_seq_cst) > 0) futex(team->generation, FUTEX_WAKE_PRIVATE, INT32_MAX);
      return;
    }
    const auto since = std::chrono::steady_clock::now();
    const BarrierWait wait = barrier_wait();
    auto waited = std::chrono::nanoseconds(0);
    for (int64_t i = 1; team->generation.load(std::memory_order_acquire) == gen; ++i) {
      if (team->failed.load(std::memory_order_acquire)) throw TeamFailed{};
      if (i % 64 == 0) waited = std::chrono::steady_clock::now() - since;
      if (waited < wait.spin) {
        _mm_pause();
      } else if (waited < wait.total) {
        std::this_thread::yield();
        waited = std::chrono::steady_clock::now() - since;
      } else {
        team->sleepers.fetch_add(1, std::memory_order_seq_cst);
        if (team->generation.load(std::memory_order_seq_cst) == gen) futex(team->generation, FUTEX_WAIT_PRIVATE, gen);
        team->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      }
    }
    if (team->failed.load(std::memory_order_acquire)) throw TeamFailed{};
  }
  int64_t lo(int64_t n) const { return n * tid / nt; }  // this member's share [lo, hi) of n items
  int64_t hi(int64_t n) const { return n * (tid + 1) / nt; }
};

// body(member) on each of at::get_num_threads() threads (one, inside another parallel region); an exception
// of any member is rethrown here, after every member has left
template <typename F>
void run_team(F&& body) {
  Team team;
  const int want = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(want)
  {
    Member me{&team, omp_get_thread_num(), omp_get_num_threads()};
    try {
      body(me);
    } catch (const TeamFailed&) {
    } catch (...) {
      if (!team.failed.exchange(true)) team.error = std::current_exception();
      team.generation.fetch_add(1, std::memory_order_seq_cst);  // wakes the members asleep at a barrier
      futex(team.generation, FUTEX_WAKE_PRIVATE, INT32_MAX);
    }
  }
  if (team.error) std::rethrow_exception(team.error);
}

// An activation in the layout of the packed weights that read it: float32 rows (x, row stride ldx), and for
// bf16-pair weights their bf16 copy (row stride K), for int8 weights their int8 rows and scales, each with the
// rows of slack the brgemm path reads past the last (zeros, or rows of an earlier use: a row's result depends
// on its own values only).
struct Act {
  const float* x = nullptr;
  int64_t ldx = 0, K = 0, slack = 0;
  bool pairs = false, i8 = false;
  std::vector<uint16_t> b;
  std::vector<kvferry_cpu::act_t> q;
  std::vector<float> s;
  Act(const float* x_, int64_t ldx_, int64_t K_, int64_t rows, const Packed& w)
      : x(x_), ldx(ldx_), K(K_), slack(kvferry_cpu::brgemm_slack(rows)), pairs(w.pairs), i8(w.i8) {
    b.assign(pairs ? (rows + slack) * K : 0, 0);
    q.assign(i8 ? (rows + slack) * K : 0, 0);
    s.assign(i8 ? rows : 0, 0.f);
  }
  void fill(int64_t r0, int64_t r1) {  // rows [r0, r1) of x into the weights' layout
#ifdef KVFERRY_AVX512BF16
    if (pairs)
      for (int64_t r = r0; r < r1; ++r) row_to_bf16(x + r * ldx, K, b.data() + r * K, K);
#endif
    if (i8)
      for (int64_t r = r0; r < r1; ++r) s[r] = kvferry_cpu::quantize_row(x + r * ldx, K, q.data() + r * K);
  }
  Rows rows(int64_t r0 = 0) const {
    return Rows{x, ldx, b.data(), q.data(), s.data(), slack > 0}.offset(r0, K);
  }
};

// out [M, N] (row stride ldo) = in [M, K] @ w, one of a phase's GEMMs
struct GemmJob {
  Packed w;
  Rows in;
  int64_t M, K, N;
  float* out;
  int64_t ldo;
};

// A member's share of a phase's GEMMs (units_in: one run of (GEMM, column block) units of equal cost)
void run_jobs(const GemmJob* jobs, int64_t n, const Member& me) {
  auto size = [&](int64_t i) { return std::pair{jobs[i].M, (jobs[i].N + NB - 1) / NB}; };
  const int64_t total = units_cost(n, size);
  units_in(n, size, me.lo(total), me.hi(total), [&](int64_t i, int64_t b0, int64_t b1) {
    const GemmJob& j = jobs[i];
    if (j.M > 0) gemm_blocks(j.w, j.in, j.M, j.K, j.N, j.out, j.ldo, b0, b1);
  });
}

}  // namespace

namespace {

// Whether latent_layers_team serves latent_decode_layers' weights (else the step runs op by op): every
// packed weight of one layout (the activations are converted once for all the weights that read them:
// float32 / bf16 blocks, bf16 pairs where this build has the bf16 dot product, or int8), every MoE layer of
// one shape (router [H, E] and correction bias contiguous float32, routed and shared widths), every dense
// layer of one width
bool team_serves(at::TensorList weights) {
  constexpr int64_t PER_LAYER = 16;
  int kind = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(weights.size()); ++i) {
    const int64_t slot = i % PER_LAYER;
    const bool packed = slot == 1 || slot == 3 || slot == 4 || slot == 8 || slot >= 12;
    if (!packed || weights[i].numel() == 0) continue;
    const int k = is_int8(weights[i]) ? 2 : is_bf16_pairs(weights[i]) ? 1 : 0;
    if (kind >= 0 && k != kind) return false;
    kind = k;
  }
  if (kind == 1 && !has_bf16_dot()) return false;
  std::vector<int64_t> moe_shape, dense_width;
  for (int64_t l = 0; l < static_cast<int64_t>(weights.size()) / PER_LAYER; ++l) {
    const at::Tensor* w = weights.data() + l * PER_LAYER;
    if (w[10].numel() > 0) {
      const bool ok = w[10].scalar_type() == at::kFloat && w[11].scalar_type() == at::kFloat && w[10].dim() == 2 &&
                      w[10].is_contiguous() && w[11].is_contiguous() && w[12].dim() == 4 && w[13].dim() == 4;
      if (!ok) return false;
      const std::vector<int64_t> shape{w[10].size(1), packed_k(w[13]), w[14].numel() > 0 ? packed_k(w[15]) : 0};
      if (!moe_shape.empty() && shape != moe_shape) return false;
      moe_shape = shape;
    } else {
      const std::vector<int64_t> width{packed_k(w[13])};
      if (!dense_width.empty() && width != dense_width) return false;
      dense_width = width;
    }
  }
  return true;
}

// the index of x[0:n]'s largest value, the first of equal ones, a NaN counting as the largest (the first NaN):
// numpy's argmax, which the sampler's greedy rows take (model/sampler.py argmax_rows); 0 for an empty row
int64_t argmax_row(const float* x, int64_t n) {
  if (n <= 0) return 0;
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_max_ps(top, v);
  }
  float best = kvferry_cpu::hmax8(top);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t j = i; j < n; ++j) {
    if (std::isnan(x[j])) any_nan = true;
    else best = std::max(best, x[j]);
  }
  // the first NaN, else the first value equal to the largest
  const __m256 b = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const int hit = _mm256_movemask_ps(any_nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, b, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (any_nan ? std::isnan(x[i]) : x[i] == best) return i;
  return 0;  // (not reached)
}

// argmax_row of each row of logits [T, V] (float32; the tests hold it against numpy's argmax)
std::vector<int64_t> logits_argmax(const at::Tensor& logits_) {
  check_f32(logits_, "logits");
  TORCH_CHECK(logits_.dim() == 2, "logits [T, V]");
  const auto logits = logits_.contiguous();
  std::vector<int64_t> best(logits.size(0));
  for (int64_t t = 0; t < logits.size(0); ++t)
    best[t] = argmax_row(logits.data_ptr<float>() + t * logits.size(1), logits.size(1));
  return best;
}

// a layer's weights as latent_layers_team reads them, taken from the tensors once (check_team_weights): a step
// reads these few lines, not each weight's tensor metadata, which its own weight stream has evicted by the next
struct TeamLayer {
  const float *norm = nullptr, *q_a_norm = nullptr, *kv_norm = nullptr, *post_norm = nullptr, *router = nullptr,
              *bias = nullptr;
  Packed q_a, q, kv_a, o, mlp13, mlp2;  // q: q_b with a q LoRA; mlp13 / mlp2: the shared experts' or a dense MLP's
  bool moe = false, shared = false;
  int64_t width = 0;  // a dense MLP's
};

// latent_decode_layers' part that is the model's, not the step's: its weights, embedding, rope tables, final
// norm and LM head, their shapes and layouts checked once (kvferry_cpu.LatentStep: the model builds one and
// runs every decode step through it, so a step passes seven tensors, not 16 per layer, and checks only its own
// inputs). latent_decode_layers builds one for its call.
struct LatentStep : torch::CustomClassHolder {
  static constexpr int64_t PER_LAYER = 16;
  at::Tensor embed, cos_table, sin_table, final_norm, lm_head;
  std::vector<at::Tensor> weights;
  double eps, scale;
  int64_t top_k;
  bool renormalize;
  int64_t n_group, topk_group;
  double routed_scaling;
  int64_t vocab;
  // layers, hidden width, the dims (heads, nope, rope, rank, v), the q LoRA rank (0: none)
  int64_t L, H, heads, nope, rope, rank, vd, qa;
  bool team = false;  // team_serves(weights): the one-region step (latent_layers_team) serves a float32 cache
  // (team) routed experts and their width, the shared experts' and dense layers' width; each layer's W_uk / W_uv
  int64_t E = 0, I = 0, Is = 0, Id = 0;
  std::vector<Absorbed> up;
  // (team) each layer's TeamLayer; the routed experts' packed weights, [L, E, 2] (w13, w2); the final norm and LM head
  std::vector<TeamLayer> layers;
  std::vector<Packed> experts;
  const float* final_norm_p = nullptr;
  Packed head;

  LatentStep(at::Tensor embed_, std::vector<at::Tensor> weights_, at::Tensor cos_, at::Tensor sin_,
             at::Tensor final_norm_, std::vector<int64_t> dims_, double eps_, double scale_, int64_t top_k_,
             bool renormalize_, int64_t n_group_, int64_t topk_group_, double routed_scaling_, at::Tensor lm_head_,
             int64_t vocab_);
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& input_ids, at::Tensor kv_cache, const at::Tensor& positions,
                                         const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                                         const at::Tensor& block_tables, const at::Tensor& context_lens);
  // run on a step's integers as lists (the engine's decode-only steps: after a step has streamed the weights
  // through the caches, each torch op that builds the step's tensors costs tens of us); block_tables: the
  // rows [T, width] flat. Also each logits row's argmax (argmax_row; empty without the LM head): a greedy
  // row's token, found while the logits are still in cache (numpy's argmax, called cold, costs ~60 us)
  std::tuple<at::Tensor, at::Tensor, std::vector<int64_t>> run_lists(
      std::vector<int64_t> input_ids, at::Tensor kv_cache, std::vector<int64_t> positions,
      std::vector<int64_t> slot_blocks, std::vector<int64_t> slot_offsets, std::vector<int64_t> block_tables,
      std::vector<int64_t> context_lens) {
    const int64_t T = static_cast<int64_t>(input_ids.size());
    TORCH_CHECK(T > 0 && block_tables.size() % T == 0, "block_tables: one row per token");
    const auto of = [](std::vector<int64_t>& v) {
      return at::from_blob(v.data(), {static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(at::kLong));
    };
    auto [hidden, logits] = run(of(input_ids), kv_cache, of(positions), of(slot_blocks), of(slot_offsets),
                                of(block_tables).view({T, static_cast<int64_t>(block_tables.size()) / T}),
                                of(context_lens));
    return {hidden, logits, logits_argmax(logits)};
  }
  // `steps` greedy decode steps in one call (the engine's multi-step decode, EngineConfig.num_scheduler_steps):
  // step j's tokens are step j - 1's argmax (argmax_row, the greedy sampler's rule), its positions and context
  // lengths one more, its KV slot its block table's entry for its position. block_tables: the rows [T, width]
  // flat (padded); counts: each row's own blocks, which must hold every position the call computes. The
  // tokens sampled [steps * T], step by step.
  std::vector<int64_t> run_burst(std::vector<int64_t> input_ids, at::Tensor kv_cache, std::vector<int64_t> positions,
                                 std::vector<int64_t> block_tables, std::vector<int64_t> counts,
                                 std::vector<int64_t> context_lens, int64_t steps) {
    const int64_t T = static_cast<int64_t>(input_ids.size());
    TORCH_CHECK(T > 0 && steps > 0, "run_burst: at least one token and one step");
    TORCH_CHECK(block_tables.size() % T == 0 && static_cast<int64_t>(positions.size()) == T &&
                    static_cast<int64_t>(counts.size()) == T && static_cast<int64_t>(context_lens.size()) == T,
                "run_burst: one position, block count, context length and block table row per token");
    TORCH_CHECK(lm_head.numel() > 0, "run_burst: a model with its LM head");
    TORCH_CHECK(kv_cache.dim() == 6, "kv_cache [L, 2, 1, blocks, bs, W/2]");
    const int64_t width = static_cast<int64_t>(block_tables.size()) / T, bs = kv_cache.size(4);
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(counts[t] <= width && positions[t] >= 0 && positions[t] + steps <= counts[t] * bs,
                  "run_burst: a row's blocks do not hold the positions of every step");
    std::vector<int64_t> slot_blocks(T), slot_offsets(T), tokens;
    tokens.reserve(steps * T);
    for (int64_t j = 0; j < steps; ++j) {
      for (int64_t t = 0; t < T; ++t) {
        slot_blocks[t] = block_tables[t * width + positions[t] / bs];
        slot_offsets[t] = positions[t] % bs;
      }
      auto best = std::get<2>(run_lists(input_ids, kv_cache, positions, slot_blocks, slot_offsets, block_tables,
                                        context_lens));
      tokens.insert(tokens.end(), best.begin(), best.end());
      input_ids = std::move(best);
      for (int64_t t = 0; t < T; ++t) {
        ++positions[t];
        ++context_lens[t];
      }
    }
    return tokens;
  }
};

// the team's weight checks (LatentStep's constructor, where team_serves): shapes and layouts, once; then the
// pointers and layouts the team reads (layers, experts, final_norm_p, head)
void check_team_weights(LatentStep& s) {
  const int64_t H = s.H, L = s.L, heads = s.heads, nope = s.nope, rank = s.rank, vd = s.vd, qa = s.qa;
  const int64_t Q = heads * (nope + s.rope), W = rank + s.rope, HV = heads * vd;
  const bool lora = qa > 0;
  const auto& weights = s.weights;
  int64_t E = 0, I = 0, Is = 0, Id = 0;  // routed experts, their width; the shared experts' and dense layers' width
  std::vector<Absorbed> up(L);            // each layer's W_uk / W_uv
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * LatentStep::PER_LAYER;
    for (int64_t i : {0, 5, 9}) check_f32(w[i], "norm weight");
    TORCH_CHECK(w[0].numel() == H && w[5].numel() == rank && w[9].numel() == H, "norm weights");
    if (lora) {
      check_f32(w[2], "q_a norm");
      TORCH_CHECK(w[2].numel() == qa, "q_a norm");
      check_packed(w[1], H, qa);
      check_packed(w[3], qa, Q);
    } else {
      check_packed(w[3], H, Q);
    }
    check_packed(w[4], H, W);
    up[l] = absorbed_of(w[6], w[7], heads, nope, rank, vd);
    check_packed(w[8], HV, H);
    if (w[10].numel() > 0) {
      check_f32(w[10], "router");
      check_f32(w[11], "correction bias");
      TORCH_CHECK(w[10].size(0) == H && w[12].size(0) == w[10].size(1) && w[13].size(0) == w[10].size(1),
                  "router [H, E], experts [E, ...]");
      E = w[10].size(1);
      I = packed_k(w[13]);
      check_grouping(E, s.top_k, s.n_group, s.topk_group, w[11].numel());
      check_packed(w[12][0], H, 2 * I);
      check_packed(w[13][0], I, H);
      if (w[14].numel() > 0) {
        Is = packed_k(w[15]);
        check_packed(w[14], H, 2 * Is);
        check_packed(w[15], Is, H);
      }
    } else {
      Id = packed_k(w[13]);
      check_packed(w[12], H, 2 * packed_k(w[13]));
      check_packed(w[13], packed_k(w[13]), H);
    }
  }
  TORCH_CHECK(!is_bf16_pairs(weights[lora ? 1 : 3]) || (H % 2 == 0 && qa % 2 == 0 && HV % 2 == 0),
              "even widths (the bf16-pair layout)");
  s.E = E;
  s.I = I;
  s.Is = Is;
  s.Id = Id;
  s.up = std::move(up);
  s.layers.assign(L, TeamLayer{});
  s.experts.assign(L * E * 2, Packed{});
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * LatentStep::PER_LAYER;
    TeamLayer& t = s.layers[l];
    t.norm = w[0].data_ptr<float>();
    t.kv_norm = w[5].data_ptr<float>();
    t.post_norm = w[9].data_ptr<float>();
    if (lora) {
      t.q_a_norm = w[2].data_ptr<float>();
      t.q_a = Packed(w[1]);
    }
    t.q = Packed(w[3]);
    t.kv_a = Packed(w[4]);
    t.o = Packed(w[8]);
    t.moe = w[10].numel() > 0;
    t.shared = t.moe && w[14].numel() > 0;
    if (t.moe) {
      t.router = w[10].data_ptr<float>();
      t.bias = w[11].data_ptr<float>();
      for (int64_t e = 0; e < E; ++e) {
        s.experts[(l * E + e) * 2] = Packed(w[12], e);
        s.experts[(l * E + e) * 2 + 1] = Packed(w[13], e);
      }
      if (t.shared) {
        t.mlp13 = Packed(w[14]);
        t.mlp2 = Packed(w[15]);
      }
    } else {
      t.mlp13 = Packed(w[12]);
      t.mlp2 = Packed(w[13]);
      t.width = packed_k(w[13]);
    }
  }
  s.final_norm_p = s.final_norm.data_ptr<float>();
  if (s.lm_head.numel() > 0) s.head = Packed(s.lm_head);
}

// latent_decode_layers on a float32 latent cache: the whole step in one parallel region (Team). Each layer is
// a dozen phases between barriers: row phases (norms, RoPE and the cache write, routing, SiLU, the weighted
// sum), each member its share of the rows; GEMM phases, each member its share of the column blocks of all
// the phase's GEMMs (q_a with kv_a; every expert hit with the shared experts); the attention, each member
// its share of (sequence, group of heads). The kernels are the layer-by-layer forward's, so the bits are.
at::Tensor latent_layers_team(const LatentStep& s, const at::Tensor& x_, float* const* first, float* const* second,
                              const LatentRows& lr0, const float* cosp, const float* sinp, const int64_t* sbp,
                              const int64_t* sop, int64_t num_blocks, int64_t bs, float* logits_out) {
  const int64_t heads = s.heads, nope = s.nope, rope = s.rope, rank = s.rank, vd = s.vd, qa = s.qa;
  const int64_t L = s.L, H = x_.size(1), T = x_.size(0), top_k = s.top_k, vocab = s.vocab;
  const int64_t qk = nope + rope, W = rank + rope, Q = heads * qk, HV = heads * vd;
  const int64_t E = s.E, I = s.I, Is = s.Is, Id = s.Id;
  const bool lora = qa > 0;
  const double eps = s.eps;
  const std::vector<Absorbed>& up = s.up;
  const int64_t groups = latent_head_groups(T, heads), per = (heads + groups - 1) / groups;

  // the step's activations (raw rows, shared by the members)
  const int64_t A = T * top_k;  // routed rows at most
  const int64_t Iw = std::max(Is, Id);
  std::vector<float> buf(T * (H + 2 * qa + 2 * Q + 2 * W + rank + HV + 3 * H + Iw * 2 + H) + A * (H + 2 * I + H) +
                         T * (E + top_k));
  float* hp = buf.data();  // the normalised input [T, H]
  float *qa_raw = hp + T * H, *qa_n = qa_raw + T * qa, *qp = qa_n + T * qa, *lat = qp + T * Q, *cp = lat + T * W,
        *qrot = cp + T * rank, *rows = qrot + T * Q, *att = rows + T * W, *op = att + T * HV, *h2 = op + T * H,
        *xo = h2 + T * H, *hs13 = xo + T * H, *ys = hs13 + T * 2 * Iw, *xs = ys + T * H, *h13 = xs + A * H,
        *y = h13 + A * 2 * I, *logits = y + A * H, *wts = logits + T * E;
  std::vector<int64_t> ids(A);
  auto out = at::empty({T, H}, x_.options());
  float *xp = x_.data_ptr<float>(), *outp = out.data_ptr<float>();
  const Packed q_in = lora ? s.layers[0].q_a : s.layers[0].q;  // the layouts (uniform_layout: one for all)
  Act a_h(hp, H, H, T, q_in), a_qa(qa_n, qa, qa, T, q_in), a_att(att, HV, HV, T, q_in), a_h2(h2, H, H, T, q_in),
      a_g(xs, H, H, A, q_in), a_hr(h13, 2 * I, I, A, q_in), a_hs(hs13, 2 * Iw, Is, T, q_in),
      a_hd(hs13, 2 * Iw, Id, T, q_in);  // (the shared experts' and a dense layer's hidden rows share a buffer)

  const bool head = logits_out != nullptr;  // the LM head too: a last GEMM phase over the vocabulary's blocks
  Act a_out(outp, H, H, T, head ? s.head : q_in);

  run_team([&](Member& me) {
    const int64_t t0 = me.lo(T), t1 = me.hi(T), n = t1 - t0;
    std::vector<float> scores, query(per * W), attn(per * rank);
    std::vector<int64_t> start(E + 1), row_of(A), token_of(A), fill(E);
    std::vector<GemmJob> jobs;
    std::vector<std::pair<int64_t, int64_t>> terms;
    const float* ysp = nullptr;  // the previous layer's shared experts' rows (null: none)
    bool routed = false;         // whether the previous layer's MLP was routed (its sum is still to do)
    auto finish_mlp = [&]() {   // the previous layer's MLP output, rows [t0, t1), into xo
      if (routed)
        for (int64_t t = t0; t < t1; ++t)
          combine_token(t, top_k, ids.data(), wts, row_of.data(), y, ysp, H, xo + t * H, terms);
    };
    for (int64_t l = 0; l < L; ++l) {
      const TeamLayer& w = s.layers[l];
      const Packed* ex = s.experts.data() + l * E * 2;  // (an MoE layer's)
      // the input norm (the first layer: of the embeddings, which start the residual stream)
      if (l == 0) {
        rms_norm_rows(xp + t0 * H, H, n, H, w.norm, eps, hp + t0 * H, H);
      } else {
        finish_mlp();
        add_rms_norm_rows(xo + t0 * H, xp + t0 * H, n, H, w.norm, eps, hp + t0 * H);
      }
      a_h.fill(t0, t1);
      me.sync();
      jobs.clear();
      if (lora)
        jobs.push_back({w.q_a, a_h.rows(), T, a_h.K, qa, qa_raw, qa});
      else
        jobs.push_back({w.q, a_h.rows(), T, a_h.K, Q, qp, Q});
      jobs.push_back({w.kv_a, a_h.rows(), T, a_h.K, W, lat, W});
      run_jobs(jobs.data(), jobs.size(), me);
      me.sync();
      rms_norm_rows(lat + t0 * W, W, n, rank, w.kv_norm, eps, cp + t0 * rank, rank);
      if (lora) {
        rms_norm_rows(qa_raw + t0 * qa, qa, n, qa, w.q_a_norm, eps, qa_n + t0 * qa, qa);
        a_qa.fill(t0, t1);
        me.sync();
        const GemmJob q_b{w.q, a_qa.rows(), T, a_qa.K, Q, qp, Q};
        run_jobs(&q_b, 1, me);
        me.sync();
      }
      latent_rope_store_rows(qp + t0 * Q, lat + t0 * W, cp + t0 * rank, cosp + t0 * rope, sinp + t0 * rope, n, heads, qk,
                             rank, rope, first[l], second[l], false, num_blocks, bs, sbp + t0, sop + t0,
                             qrot + t0 * Q, rows + t0 * W);
      me.sync();
      // the absorbed attention (latent_decode_rows), a member's share of (sequence, group of heads)
      LatentRows lr = lr0;
      lr.p0 = first[l];
      lr.p1 = second[l];
      for (int64_t item = me.lo(T * groups); item < me.hi(T * groups); ++item)
        latent_decode_item(qrot, heads, qk, nope, vd, up[l], lr, item, groups, per, query, attn, scores, att);
      me.sync();
      if (a_att.pairs || a_att.i8) {
        a_att.fill(t0, t1);
        me.sync();
      }
      const GemmJob o{w.o, a_att.rows(), T, a_att.K, H, op, H};
      run_jobs(&o, 1, me);
      me.sync();
      // the post-attention norm; routing
      add_rms_norm_rows(op + t0 * H, xp + t0 * H, n, H, w.post_norm, eps, h2 + t0 * H);
      a_h2.fill(t0, t1);
      const bool moe = w.moe, shared = w.shared;
      if (moe) {
        router_logits_rows(h2, t0, t1, H, w.router, E, logits);
        grouped_topk_rows(logits, t0, t1, E, w.bias, top_k, s.renormalize, s.n_group,
                          s.topk_group, s.routed_scaling, wts, ids.data());
      }
      me.sync();
      jobs.clear();
      int64_t total = 0;
      if (moe) {  // every member groups the assignments by expert (moe_chunk's order), then gathers its share
        std::fill(start.begin(), start.end(), 0);
        for (int64_t a = 0; a < A; ++a) ++start[ids[a] + 1];
        for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
        std::copy(start.begin(), start.end() - 1, fill.begin());
        for (int64_t a = 0; a < A; ++a) {
          row_of[a] = fill[ids[a]]++;
          token_of[row_of[a]] = a / top_k;
        }
        total = A;
        for (int64_t r = me.lo(total); r < me.hi(total); ++r) std::copy_n(h2 + token_of[r] * H, H, xs + r * H);
        a_g.fill(me.lo(total), me.hi(total));
        me.sync();
        for (int64_t e = 0; e < E; ++e)
          if (start[e + 1] > start[e])
            jobs.push_back({ex[e * 2], a_g.rows(start[e]), start[e + 1] - start[e], H, 2 * I,
                            h13 + start[e] * 2 * I, 2 * I});
      }
      const int64_t In = moe ? Is : w.width;  // the shared experts' or the dense MLP's width
      if (!moe || shared) jobs.push_back({w.mlp13, a_h2.rows(), T, H, 2 * In, hs13, 2 * Iw});
      run_jobs(jobs.data(), jobs.size(), me);
      me.sync();
      // SiLU * up of every routed row, then of the shared / dense rows
      const int64_t extra = (!moe || shared) ? T : 0;
      for (int64_t r = me.lo(total + extra); r < me.hi(total + extra); ++r) {
        if (r < total) {
          silu_mul(h13 + r * 2 * I, I);
          a_hr.fill(r, r + 1);
        } else {
          silu_mul(hs13 + (r - total) * 2 * Iw, In);
          (moe ? a_hs : a_hd).fill(r - total, r - total + 1);
        }
      }
      me.sync();
      jobs.clear();
      if (moe)
        for (int64_t e = 0; e < E; ++e)
          if (start[e + 1] > start[e])
            jobs.push_back(
                {ex[e * 2 + 1], a_hr.rows(start[e]), start[e + 1] - start[e], I, H, y + start[e] * H, H});
      if (!moe || shared)
        jobs.push_back({w.mlp2, (moe ? a_hs : a_hd).rows(), T, In, H, moe ? ys : xo, H});
      run_jobs(jobs.data(), jobs.size(), me);
      me.sync();
      routed = moe;
      ysp = shared ? ys : nullptr;
    }
    finish_mlp();
    add_rms_norm_rows(xo + t0 * H, xp + t0 * H, n, H, s.final_norm_p, eps, outp + t0 * H);
    if (head) {
      a_out.fill(t0, t1);
      me.sync();
      const GemmJob lm{s.head, a_out.rows(), T, H, vocab, logits_out, vocab};
      run_jobs(&lm, 1, me);
    }
  });
  return out;
}

}  // namespace

// tests: member `member` of the first one-region step whose member reaches its barrier number `sync` raises
// there (-1: no fault)
void set_team_fault(int64_t member, int64_t sync) {
  TORCH_CHECK(member < 1024 && sync < 1024, "set_team_fault: member and sync below 1024");
  team_fault().store(member < 0 || sync < 0 ? -1 : member * 1024 + sync);
}

// LatentStep's model part, checked once: embed [V, H]; weights, 16 per layer (latent_decode_layers); the cos /
// sin tables [P, rope]; the final norm; lm_head: the packed LM head [H, vocab] (empty: none); dims: heads, nope,
// rope, rank, v. Where the one-region step serves these weights (team_serves), their shapes and layouts for it.
LatentStep::LatentStep(at::Tensor embed_, std::vector<at::Tensor> weights_, at::Tensor cos_, at::Tensor sin_,
                       at::Tensor final_norm_, std::vector<int64_t> dims_, double eps_, double scale_, int64_t top_k_,
                       bool renormalize_, int64_t n_group_, int64_t topk_group_, double routed_scaling_,
                       at::Tensor lm_head_, int64_t vocab_)
    : embed(std::move(embed_)),
      cos_table(std::move(cos_)),
      sin_table(std::move(sin_)),
      final_norm(std::move(final_norm_)),
      lm_head(std::move(lm_head_)),
      weights(std::move(weights_)),
      eps(eps_),
      scale(scale_),
      top_k(top_k_),
      renormalize(renormalize_),
      n_group(n_group_),
      topk_group(topk_group_),
      routed_scaling(routed_scaling_),
      vocab(vocab_) {
  TORCH_CHECK(dims_.size() == 5, "dims: heads, nope, rope, rank, v");
  heads = dims_[0], nope = dims_[1], rope = dims_[2], rank = dims_[3], vd = dims_[4];
  check_f32(embed, "embed");
  check_f32(cos_table, "cos");
  check_f32(sin_table, "sin");
  L = static_cast<int64_t>(weights.size()) / PER_LAYER;
  H = embed.size(1);
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == L * PER_LAYER,
              "latent_decode_layers: 16 weights per layer");
  TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous(), "embed [V, H], contiguous");
  TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) == rope && cos_table.is_contiguous() &&
                  sin_table.sizes() == cos_table.sizes() && sin_table.is_contiguous(),
              "cos / sin tables [positions, rope], contiguous");
  TORCH_CHECK(rope % 2 == 0, "rope: even");
  qa = weights[1].numel() > 0 ? weights[2].size(0) : 0;
  if (lm_head.numel() > 0) {  // lm_head (packed [H, vocab]; empty: none)
    check_packed(lm_head, H, vocab);
    TORCH_CHECK(!is_bf16_pairs(lm_head) || H % 2 == 0, "even widths (the bf16-pair layout)");
  }
  team = team_serves(weights);
  if (team) {
    check_f32(final_norm, "final norm");
    TORCH_CHECK(final_norm.numel() == H, "final norm");
    check_team_weights(*this);
  }
}

// decode_layers for DeepSeek-V3 (latent attention, model/mla.py; grouped routing and shared experts,
// model/moe.py): the same ATen ops and kernels in the same order as the Python forward. kv_cache
// [L, 2, 1, blocks, bs, W/2] (the latent's halves; float32 or int8 rows). The step's tokens input_ids [T] are
// looked up in the embedding and their positions [T] in the cos / sin tables here, not by the caller (a torch op
// between two steps costs tens of microseconds). Returns the final hidden states [T, H] and their logits
// [T, vocab] (empty without an LM head).
std::tuple<at::Tensor, at::Tensor> LatentStep::run(const at::Tensor& input_ids_, at::Tensor kv_cache,
                                                   const at::Tensor& positions_, const at::Tensor& slot_blocks_,
                                                   const at::Tensor& slot_offsets_, const at::Tensor& block_tables_,
                                                   const at::Tensor& context_lens_) {
  const auto input_ids = as_contiguous(input_ids_, at::kLong), positions = as_contiguous(positions_, at::kLong);
  const int64_t T = input_ids.numel();
  TORCH_CHECK(T > 0 && positions.numel() == T, "one position per token; at least one token");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == L && kv_cache.size(1) == 2,
              "kv_cache [L, 2, 1, blocks, bs, W/2]: one layer per 16 weights");
  // the step's embeddings and rope rows (what F.embedding and the tables' indexing give)
  const auto x_ = at::empty({T, H}, embed.options());
  const auto cos = at::empty({T, rope}, cos_table.options()), sin = at::empty({T, rope}, cos_table.options());
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = input_ids.data_ptr<int64_t>()[t], pos = positions.data_ptr<int64_t>()[t];
    TORCH_CHECK(id >= 0 && id < embed.size(0), "token id out of range");
    TORCH_CHECK(pos >= 0 && pos < cos_table.size(0), "position out of range");
    std::copy_n(embed.data_ptr<float>() + id * H, H, x_.data_ptr<float>() + t * H);
    std::copy_n(cos_table.data_ptr<float>() + pos * rope, rope, cos.data_ptr<float>() + t * rope);
    std::copy_n(sin_table.data_ptr<float>() + pos * rope, rope, sin.data_ptr<float>() + t * rope);
  }
  const auto slot_blocks = as_contiguous(slot_blocks_, at::kLong), slot_offsets = as_contiguous(slot_offsets_, at::kLong);
  const auto block_tables = as_contiguous(block_tables_, at::kLong), context_lens = as_contiguous(context_lens_, at::kLong);
  const int64_t qk = nope + rope, W = rank + rope, Q = heads * qk;
  const bool lora = qa > 0;
  const at::Tensor layer0 = kv_cache.select(0, 0), first0 = layer0.select(0, 0), second0 = layer0.select(0, 1);
  check_latent_planes(first0, second0, W);
  TORCH_CHECK(first0.size(0) == 1, "latent planes [1, blocks, bs, (rank + rope) / 2]");
  TORCH_CHECK(slot_blocks.numel() == T && slot_offsets.numel() == T && context_lens.numel() == T &&
                  block_tables.dim() == 2 && block_tables.size(0) == T,
              "one slot, context length and block table row per token");
  const float *cosp = cos.data_ptr<float>(), *sinp = sin.data_ptr<float>();
  const int64_t *sbp = slot_blocks.data_ptr<int64_t>(), *sop = slot_offsets.data_ptr<int64_t>();
  const bool head = lm_head.numel() > 0;
  auto logits = at::empty({head ? T : 0, head ? vocab : 0}, x_.options());
  if (first0.scalar_type() == at::kFloat && team) {
    // every layer's planes share layer 0's shape and strides: their rows by pointer, not as views
    const int64_t num_blocks = first0.size(1), bs = first0.size(2);
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(sbp[t] >= 0 && sbp[t] < num_blocks && sop[t] >= 0 && sop[t] < bs, "slot out of range");
    std::vector<at::Tensor> keep;
    const LatentRows lr0 = latent_rows_of(first0, second0, block_tables, context_lens, rank, 0, scale, keep);
    std::vector<float*> first(L), second(L);
    float* base = kv_cache.data_ptr<float>();
    for (int64_t l = 0; l < L; ++l) {
      first[l] = base + l * kv_cache.stride(0);
      second[l] = first[l] + kv_cache.stride(1);
    }
    auto out = latent_layers_team(*this, x_, first.data(), second.data(), lr0, cosp, sinp, sbp, sop, num_blocks, bs,
                                  head ? logits.data_ptr<float>() : nullptr);
    return {out, logits};
  }
  std::vector<std::vector<at::Tensor>> planes;  // layer l's two planes (views of kv_cache)
  for (const auto& layer : kv_cache.unbind(0)) planes.push_back(layer.unbind(0));
  // the attention's activations, raw rows in one buffer that every layer reuses (the kernels below are the
  // Python forward's, on rows: the same bits without an allocation and a dispatch per op)
  auto work = at::empty({T * (H + 2 * qa + 2 * Q + 2 * W + rank + heads * vd + H)}, x_.options());
  float* hp = work.data_ptr<float>();  // the normalised input [T, H]
  float *qa_raw = hp + T * H, *qa_normed = qa_raw + T * qa, *qp = qa_normed + T * qa, *lat = qp + T * Q,
        *cp = lat + T * W, *qrot = cp + T * rank, *rows = qrot + T * Q, *att = rows + T * W, *op = att + T * heads * vd;
  auto h = at::empty({T, H}, x_.options());  // the post-attention norm's output, which the MLP ops take
  at::Tensor x = x_, residual = x_;  // (the residual stream starts as the input, added to in place)
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + l * PER_LAYER;
    at::Tensor &first = planes[l][0], &second = planes[l][1];
    if (l == 0)
      rms_norm_rows(x.data_ptr<float>(), H, T, H, w[0].data_ptr<float>(), eps, hp, H);
    else
      add_rms_norm_rows(x.data_ptr<float>(), residual.data_ptr<float>(), T, H, w[0].data_ptr<float>(), eps, hp);
    if (lora) {
      check_packed(w[1], H, qa);
      check_packed(w[3], qa, Q);
      gemm(hp, H, T, H, w[1], qa, qa_raw, qa);
      rms_norm_rows(qa_raw, qa, T, qa, w[2].data_ptr<float>(), eps, qa_normed, qa);
      gemm(qa_normed, qa, T, qa, w[3], Q, qp, Q);
    } else {
      check_packed(w[3], H, Q);
      gemm(hp, H, T, H, w[3], Q, qp, Q);
    }
    check_packed(w[4], H, W);
    gemm(hp, H, T, H, w[4], W, lat, W);
    rms_norm_rows(lat, W, T, rank, w[5].data_ptr<float>(), eps, cp, rank);  // c: the latent's first rank values
    latent_rope_store_rows(qp, lat, cp, cosp, sinp, T, heads, qk, rank, rope, first.data_ptr(), second.data_ptr(),
                           first.scalar_type() == at::kChar, first.size(1), first.size(2), sbp, sop, qrot, rows);
    std::vector<at::Tensor> keep;
    const LatentRows lr = latent_rows_of(first, second, block_tables, context_lens, rank, 0, scale, keep);
    latent_decode_rows(qrot, T, heads, qk, nope, vd, absorbed_of(w[6], w[7], heads, nope, rank, vd), lr, att);
    check_packed(w[8], heads * vd, H);
    gemm(att, heads * vd, T, heads * vd, w[8], H, op, H);
    add_rms_norm_rows(op, residual.data_ptr<float>(), T, H, w[9].data_ptr<float>(), eps, h.data_ptr<float>());
    if (w[10].numel() > 0) {
      auto [top, ids] = grouped_route(h, w[10], w[11], top_k, renormalize, n_group, topk_group, routed_scaling);
      x = moe_experts(h, ids, top, w[12], w[13], 0);
      if (w[14].numel() > 0) x.add_(gated_mlp(h, w[14], w[15]));
    } else {
      x = gated_mlp(h, w[12], w[13]);
    }
  }
  auto out = add_rms_norm(x, residual, final_norm, eps);
  if (head) gemm(out.data_ptr<float>(), H, T, H, lm_head, vocab, logits.data_ptr<float>(), vocab);
  return {out, logits};
}

// decode_layers for DeepSeek-V3 as one op (LatentStep::run, the model's part checked for this call). weights: 16
// per layer: input norm, packed q_a (empty: no q LoRA), q_a norm (empty), packed q_b (or q), packed kv_a, kv_a
// norm, W_uk [H, nope, rank], W_uv [H, rank, v], packed o, post-attention norm, router [Hd, E] (empty: a dense
// MLP), correction bias [E], packed w13, packed w2, packed shared w13 (empty: none), packed shared w2
std::tuple<at::Tensor, at::Tensor> latent_decode_layers(
    const at::Tensor& input_ids, const at::Tensor& embed, at::TensorList weights, at::Tensor& kv_cache,
    const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
    const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, const at::Tensor& block_tables,
    const at::Tensor& context_lens, const at::Tensor& final_norm, at::IntArrayRef dims, double eps, double scale,
    int64_t top_k, bool renormalize, int64_t n_group, int64_t topk_group, double routed_scaling,
    const at::Tensor& lm_head, int64_t vocab) {
  LatentStep step(embed, weights.vec(), cos_table, sin_table, final_norm, dims.vec(), eps, scale, top_k, renormalize,
                  n_group, topk_group, routed_scaling, lm_head, vocab);
  return step.run(input_ids, kv_cache, positions, slot_blocks, slot_offsets, block_tables, context_lens);
}

TORCH_LIBRARY(kvferry_cpu, m) {
  m.class_<LatentStep>("LatentStep")
      .def(torch::init<at::Tensor, std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, std::vector<int64_t>,
                       double, double, int64_t, bool, int64_t, int64_t, double, at::Tensor, int64_t>())
      .def("run", &LatentStep::run)
      .def("run_lists", &LatentStep::run_lists)
      .def("run_burst", &LatentStep::run_burst);
  m.def("packed_linear(Tensor x, Tensor w, int n) -> Tensor");
  m.def("pack_weight(Tensor w) -> Tensor");
  m.def("pack_weight_bf16_pairs(Tensor w) -> Tensor");
  m.def("has_bf16_dot() -> bool", &has_bf16_dot);
  m.def("pack_weight_int8(Tensor q, Tensor scale) -> Tensor");
  m.def("has_int8_dot() -> bool", &has_int8_dot);
  m.def("int8_act_qmax() -> int", &int8_act_qmax);
  m.def("set_brgemm_min_rows(int rows) -> int", &set_brgemm_min_rows);
  m.def("brgemm_min_rows() -> int", &brgemm_min_rows);
  m.def("set_team_fault(int member, int sync) -> ()", &set_team_fault);
  m.def("logits_argmax(Tensor logits) -> int[]", &logits_argmax);
  m.def("amx_could_pack() -> bool", &amx_could_pack);
  m.def("brgemm_runs() -> bool", &brgemm_runs);
  m.def("brgemm_layout_check() -> int[]", &brgemm_layout_check);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def(
      "qk_norm_rope_store(Tensor qkv, Tensor q_weight, Tensor k_weight, float eps, Tensor cos, Tensor sin_signed, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_blocks, Tensor slot_offsets, int num_heads) -> Tensor");
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
      "float scale) -> Tensor");
  m.def(
      "latent_decode_attention(Tensor q, Tensor first, Tensor second, Tensor block_tables, Tensor context_lens, "
      "float scale, int rank, int skip=0) -> Tensor");
  m.def(
      "latent_decode_layers(Tensor input_ids, Tensor embed, Tensor[] weights, Tensor(a!) kv_cache, Tensor positions, "
      "Tensor cos, Tensor sin_signed, "
      "Tensor slot_blocks, Tensor slot_offsets, Tensor block_tables, Tensor context_lens, Tensor final_norm, int[] dims, "
      "float eps, float scale, int top_k, bool renormalize, int n_group, int topk_group, float routed_scaling, "
      "Tensor lm_head, int vocab) -> (Tensor, Tensor)");
  m.def(
      "latent_rope_store(Tensor q, Tensor latent, Tensor c, Tensor cos, Tensor sin_signed, Tensor(a!) first, "
      "Tensor(b!) second, Tensor slot_blocks, Tensor slot_offsets) -> (Tensor, Tensor)");
  m.def(
      "grouped_topk(Tensor logits, Tensor bias, int top_k, bool renormalize, int n_group, int topk_group, "
      "float scaling) -> (Tensor, Tensor)");
  m.def(
      "latent_decode(Tensor q, Tensor w_uk, Tensor w_uv, Tensor first, Tensor second, Tensor block_tables, "
      "Tensor context_lens, float scale, int skip=0) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor w13, Tensor w2, int first_expert) -> Tensor");
  m.def("gated_mlp(Tensor x, Tensor w13, Tensor w2) -> Tensor");
  m.def(
      "grouped_route(Tensor x, Tensor router, Tensor bias, int top_k, bool renormalize, int n_group, int topk_group, "
      "float scaling) -> (Tensor, Tensor)");
  m.def(
      "decode_layers(Tensor x, Tensor[] weights, Tensor(a!) kv_cache, Tensor cos, Tensor sin_signed, Tensor slot_blocks, "
      "Tensor slot_offsets, Tensor block_tables, Tensor context_lens, Tensor final_norm, int num_heads, float eps, "
      "float scale, int top_k, bool renormalize) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvferry_cpu, CPU, m) {
  m.impl("packed_linear", &packed_linear);
  m.impl("pack_weight", &pack_weight);
  m.impl("pack_weight_bf16_pairs", &pack_weight_bf16_pairs);
  m.impl("pack_weight_int8", &pack_weight_int8);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("qk_norm_rope_store", &qk_norm_rope_store);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("latent_decode_attention", &latent_decode_attention);
  m.impl("latent_decode_layers", &latent_decode_layers);
  m.impl("latent_decode", &latent_decode);
  m.impl("latent_rope_store", &latent_rope_store);
  m.impl("grouped_topk", &grouped_topk);
  m.impl("moe_experts", &moe_experts);
  m.impl("gated_mlp", &gated_mlp);
  m.impl("grouped_route", &grouped_route);
  m.impl("decode_layers", &decode_layers);
}
