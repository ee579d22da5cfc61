// int8 GEMM for `--quantization int8` (W8A8, dynamic): weights int8 per output channel, activations int8 per
// row (token), quantized here at each call; int32 accumulation; out = acc * (row scale * channel scale).
//
// Packed weight: int8 [ceil(N/16), K/4 + 2, 64] for K a multiple of 4. Row p < K/4 of block b holds
// w[4p + j, 16b + c] at byte 4c + j (four k of one column side by side: what one 32-bit lane of vpdpbusd or
// vpmaddubsw multiplies); row K/4 holds the block's 16 float32 channel scales, row K/4 + 1 its 16 int32
// compensations OFFSET * sum_k w[k, col] (the activations' unsigned offset, below). Padding columns are zero.
//
// Activations: q = round_half_even(x * (QMAX / amax(|x row|))) in [-QMAX, QMAX], scale amax / QMAX (0 for a
// zero row), stored unsigned as q + OFFSET; the compensation row takes the offset's products back out. Two
// inner loops, chosen at build time:
// - AVX512-VNNI: vpdpbusd (unsigned x signed bytes, 64 multiply-adds per instruction into int32);
//   QMAX 127, OFFSET 128.
// - AVX2: vpmaddubsw (unsigned x signed bytes, pairs summed into int16 with saturation), then vpmaddwd by
//   ones into int32. A pair sum is exact only while it fits int16: with QMAX 63, OFFSET 64 the bytes are
//   at most 127 and a pair at most 2 * 127 * 127 = 32258. So AVX2 builds quantize activations to 7 bits
//   (weights stay 8): held-out perplexity of the trained model 69.048 against 69.008 in float32 (+0.06%).
//   (8-bit activations need |q| and the weights given q's sign, vpsignb, per product: 3 more instructions
//   per 64 multiply-adds, 1.6x slower; widening both to int16 for vpmaddwd was slower still.)
// Both sum exact integers, so a build gives the bits of the torch reference (model/quant.py) with its QMAX.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace kvferry_cpu {

constexpr int64_t I8_NB = 16;  // columns per packed block

// Prefill GEMMs run every row tile over a column block while it sits in cache; when there is more than one
// row tile, the first also prefetches the next block of the thread's range into L2 (one line per weight
// row it reads), so that block does not start by waiting on L3 or DRAM. Decode's few rows (one tile) read
// each block once, in order, which the hardware prefetcher follows. `next_block` gives the next block's
// address where it is to be prefetched (`wanted`: it exists in the range and the GEMM has more than one
// row tile), else nullptr; KVFERRY_NO_PREFETCH=1 turns prefetching off (for A/B timing).
inline const char* next_block(const void* p, bool wanted) {
  static const bool off = [] {
    const char* v = std::getenv("KVFERRY_NO_PREFETCH");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }();
  return off || !wanted ? nullptr : static_cast<const char*>(p);
}

// the loop side of it: the line at `offset` bytes into the next block, into L2, once per 64-byte line (a
// loop reading 32-byte rows passes every offset; only the line starts are fetched)
inline void prefetch_next(const char* next, int64_t offset) {
  if (next && offset % 64 == 0) _mm_prefetch(next + offset, _MM_HINT_T1);
}

using act_t = uint8_t;  // activation rows are stored as q + I8_OFFSET (unsigned x signed products)
#ifdef KVFERRY_AVX512VNNI
constexpr int32_t I8_ACT_QMAX = 127, I8_OFFSET = 128;
#else
constexpr int32_t I8_ACT_QMAX = 63, I8_OFFSET = 64;
#endif

// bytes of one packed block: K/4 rows of 64 weights, then 64 bytes of scales and 64 of compensations
inline int64_t i8_block_bytes(int64_t K) { return K * I8_NB + 128; }

// one row of float32 -> q in [-I8_ACT_QMAX, I8_ACT_QMAX], stored as q + I8_OFFSET; returns the row's scale
// (NaN for a row holding a NaN, so its outputs are NaN as the reference's are, not saturated garbage)
inline float quantize_row(const float* x, int64_t K, act_t* q) {
  __m256 peak = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    peak = _mm256_max_ps(peak, _mm256_and_ps(v, abs_mask));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, peak);
  float amax = *std::max_element(lanes, lanes + 8);
  bool nan = _mm256_movemask_ps(unordered) != 0;
  for (; k < K; ++k) {
    amax = std::max(amax, std::fabs(x[k]));
    nan = nan || std::isnan(x[k]);
  }
  if (nan) {
    std::memset(q, I8_OFFSET, K);
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float inv = amax > 0.f ? static_cast<float>(I8_ACT_QMAX) / amax : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  k = 0;
  for (; k + 8 <= K; k += 8) {
    // cvtps rounds half to even (the default MXCSR mode), like torch.round
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));
    // 8 int32 in [-QMAX, QMAX] -> 8 int16 + I8_OFFSET -> 8 unsigned bytes
    const __m128i w16 = _mm_add_epi16(_mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)),
                                      _mm_set1_epi16(I8_OFFSET));
    const __m128i b8 = _mm_packus_epi16(w16, w16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), b8);
  }
  for (; k < K; ++k) q[k] = static_cast<act_t>(static_cast<int32_t>(std::nearbyint(x[k] * inv)) + I8_OFFSET);
  return amax / static_cast<float>(I8_ACT_QMAX);
}

// x [M, K] (row stride ldx) -> q [M, K] and scales [M]
inline void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, act_t* q, float* scales) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) scales[m] = quantize_row(x + m * ldx, K, q + m * K);
  });
}

#ifdef KVFERRY_AVX512VNNI
// out[r, 16c : 16c + 16] for r < R, c < C: the C blocks follow each other from w (stride i8_block_bytes)
template <int R, int C>
inline void tile_i8(const act_t* xq, const float* xs, int64_t K, const int8_t* w, float* out, int64_t ldo,
                    int64_t N, const char* next = nullptr) {
  __m512i acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
  const int32_t* xp = reinterpret_cast<const int32_t*>(xq);
  const int64_t quads = K / 4, stride = i8_block_bytes(K);
  for (int64_t p = 0; p < quads; ++p) {
    __m512i wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + c * stride + p * 64);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) prefetch_next(next, c * stride + p * 64);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_set1_epi32(xp[r * quads + p]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], xv, wv[c]);
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    const int8_t* tail = w + c * stride + K * I8_NB;
    const __m512 sw = _mm512_loadu_ps(reinterpret_cast<const float*>(tail));
    const __m512i comp = _mm512_loadu_si512(tail + 64);
    const int64_t ncols = std::min<int64_t>(I8_NB, N - c * I8_NB);
    const __mmask16 mask = (__mmask16)((1u << ncols) - 1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], comp));
      _mm512_mask_storeu_ps(out + r * ldo + c * I8_NB, mask, _mm512_mul_ps(v, _mm512_mul_ps(sw, _mm512_set1_ps(xs[r]))));
    }
  }
}

template <int R>
void few_rows_i8(const act_t* xq, const float* xs, int64_t K, const int8_t* w, int64_t N, float* out, int64_t ldo,
                 int64_t b0, int64_t b1) {
  constexpr int C = R <= 4 ? 4 : 2;
  const int64_t block = i8_block_bytes(K);
  int64_t j = b0;
  for (; j + C <= b1; j += C) tile_i8<R, C>(xq, xs, K, w + j * block, out + j * I8_NB, ldo, N - j * I8_NB);
  for (; j < b1; ++j) tile_i8<R, 1>(xq, xs, K, w + j * block, out + j * I8_NB, ldo, N - j * I8_NB);
}

constexpr int I8_MB = 8;  // rows per tile past 8 rows: 8 x 2 accumulators

inline void tile_rows_i8(int64_t rows, const act_t* xq, const float* xs, int64_t K, const int8_t* w, float* out,
                         int64_t ldo, int64_t N, const char* next) {
  switch (rows) {
    case 1: return tile_i8<1, 2>(xq, xs, K, w, out, ldo, N, next);
    case 2: return tile_i8<2, 2>(xq, xs, K, w, out, ldo, N, next);
    case 3: return tile_i8<3, 2>(xq, xs, K, w, out, ldo, N, next);
    case 4: return tile_i8<4, 2>(xq, xs, K, w, out, ldo, N, next);
    case 5: return tile_i8<5, 2>(xq, xs, K, w, out, ldo, N, next);
    case 6: return tile_i8<6, 2>(xq, xs, K, w, out, ldo, N, next);
    case 7: return tile_i8<7, 2>(xq, xs, K, w, out, ldo, N, next);
    default: return tile_i8<I8_MB, 2>(xq, xs, K, w, out, ldo, N, next);
  }
}

// column blocks [b0, b1) of out [M, N] = rows xq [M, K] @ w; serial. Past 8 rows: tiles of 8 rows x 2 blocks
// (32 columns), all row tiles over a pair of blocks while it sits in L1.
inline void gemm_i8_blocks(const act_t* xq, const float* xs, int64_t K, int64_t M, const int8_t* w, int64_t N,
                           float* out, int64_t ldo, int64_t b0, int64_t b1) {
  switch (M) {
    case 1: return few_rows_i8<1>(xq, xs, K, w, N, out, ldo, b0, b1);
    case 2: return few_rows_i8<2>(xq, xs, K, w, N, out, ldo, b0, b1);
    case 3: return few_rows_i8<3>(xq, xs, K, w, N, out, ldo, b0, b1);
    case 4: return few_rows_i8<4>(xq, xs, K, w, N, out, ldo, b0, b1);
    case 5: return few_rows_i8<5>(xq, xs, K, w, N, out, ldo, b0, b1);
    case 6: return few_rows_i8<6>(xq, xs, K, w, N, out, ldo, b0, b1);
    case 7: return few_rows_i8<7>(xq, xs, K, w, N, out, ldo, b0, b1);
    case 8: return few_rows_i8<8>(xq, xs, K, w, N, out, ldo, b0, b1);
    default: break;
  }
  const int64_t block = i8_block_bytes(K);
  int64_t j = b0;
  for (; j + 2 <= b1; j += 2) {
    const char* next = next_block(w + (j + 2) * block, j + 4 <= b1);
    for (int64_t m0 = 0; m0 < M; m0 += I8_MB)
      tile_rows_i8(std::min<int64_t>(I8_MB, M - m0), xq + m0 * K, xs + m0, K, w + j * block,
                   out + m0 * ldo + j * I8_NB, ldo, N - j * I8_NB, m0 ? nullptr : next);
  }
  for (; j < b1; ++j)
    for (int64_t m0 = 0; m0 < M; m0 += I8_MB) {
      const int64_t rows = std::min<int64_t>(I8_MB, M - m0);
      const act_t* xr = xq + m0 * K;
      float* o = out + m0 * ldo + j * I8_NB;
      const int8_t* wb = w + j * block;
      const int64_t n = N - j * I8_NB;
      switch (rows) {  // one block: C = 1
        case 1: tile_i8<1, 1>(xr, xs + m0, K, wb, o, ldo, n); break;
        case 2: tile_i8<2, 1>(xr, xs + m0, K, wb, o, ldo, n); break;
        case 3: tile_i8<3, 1>(xr, xs + m0, K, wb, o, ldo, n); break;
        case 4: tile_i8<4, 1>(xr, xs + m0, K, wb, o, ldo, n); break;
        case 5: tile_i8<5, 1>(xr, xs + m0, K, wb, o, ldo, n); break;
        case 6: tile_i8<6, 1>(xr, xs + m0, K, wb, o, ldo, n); break;
        case 7: tile_i8<7, 1>(xr, xs + m0, K, wb, o, ldo, n); break;
        default: tile_i8<8, 1>(xr, xs + m0, K, wb, o, ldo, n); break;
      }
    }
}

#else  // AVX2

// out[r, 0:16] for r < R over one block: each 64-byte row of the block is two halves of 8 columns
template <int R>
inline void tile_i8_avx2(const act_t* xq, const float* xs, int64_t K, const int8_t* w, float* out, int64_t ldo,
                         int64_t ncols, const char* next) {
  __m256i lo[R], hi[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int32_t* xp = reinterpret_cast<const int32_t*>(xq);
  const int64_t quads = K / 4;
  for (int64_t p = 0; p < quads; ++p) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64 + 32));
    prefetch_next(next, p * 64);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      // four unsigned activation bytes (<= 127) x four signed weights: pair sums <= 32258, no saturation
      const __m256i xv = _mm256_set1_epi32(xp[r * quads + p]);
      lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w0), ones));
      hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w1), ones));
    }
  }
  const int8_t* tail = w + K * I8_NB;
  const float* sw = reinterpret_cast<const float*>(tail);
  const __m256 s0 = _mm256_loadu_ps(sw), s1 = _mm256_loadu_ps(sw + 8);
  const __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail + 64));
  const __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail + 96));
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256 sx = _mm256_set1_ps(xs[r]);
    const __m256 a = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(lo[r], c0)), _mm256_mul_ps(s0, sx));
    const __m256 b = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(hi[r], c1)), _mm256_mul_ps(s1, sx));
    float* o = out + r * ldo;
    if (ncols == I8_NB) {
      _mm256_storeu_ps(o, a);
      _mm256_storeu_ps(o + 8, b);
    } else {
      alignas(32) float buf[I8_NB];
      _mm256_store_ps(buf, a);
      _mm256_store_ps(buf + 8, b);
      std::copy(buf, buf + ncols, o);
    }
  }
}

inline void gemm_i8_blocks(const act_t* xq, const float* xs, int64_t K, int64_t M, const int8_t* w, int64_t N,
                           float* out, int64_t ldo, int64_t b0, int64_t b1) {
  const int64_t block = i8_block_bytes(K);
  for (int64_t j = b0; j < b1; ++j) {
    const int64_t ncols = std::min<int64_t>(I8_NB, N - j * I8_NB);
    const char* after = next_block(w + (j + 1) * block, j + 1 < b1 && M > 4);
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const act_t* xr = xq + m0 * K;
      float* o = out + m0 * ldo + j * I8_NB;
      const int8_t* wb = w + j * block;
      const char* next = m0 ? nullptr : after;
      switch (std::min<int64_t>(4, M - m0)) {
        case 1: tile_i8_avx2<1>(xr, xs + m0, K, wb, o, ldo, ncols, next); break;
        case 2: tile_i8_avx2<2>(xr, xs + m0, K, wb, o, ldo, ncols, next); break;
        case 3: tile_i8_avx2<3>(xr, xs + m0, K, wb, o, ldo, ncols, next); break;
        default: tile_i8_avx2<4>(xr, xs + m0, K, wb, o, ldo, ncols, next); break;
      }
    }
  }
}

#endif

// int8 KV cache rows (`--kv-cache-dtype int8`): D int8 values, then the row's float32 scale (4 bytes), the
// layout of kernels/int8.py's quantize_kv / dequantize_kv and with the same arithmetic.
constexpr int64_t KV_SCALE_BYTES = 4;

inline void quantize_kv_row(const float* x, int64_t D, int8_t* dst) {
  float amax = 0.f;
  for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
  const float scale = amax / 127.f;
  std::memcpy(dst + D, &scale, sizeof(scale));
}

inline void dequantize_kv_row(const int8_t* src, int64_t D, float* dst) {
  float scale;
  std::memcpy(&scale, src + D, sizeof(scale));
  for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

}  // namespace kvferry_cpu
