// Paged prefill attention: a prefill chunk's query tokens over every cached key of their sequence, read in
// place from the paged cache through its block table, causal by position. One call per chunk, whatever part
// of the context was cached before it (a prefix-cache hit attends over the cached blocks without gathering
// them, and needs no mask tensor).
//
// Flash-style, per KV head: the head's keys are first transposed into tiles of 16 ([tile][D][16]), so a
// query row's 16 scores are D broadcast FMAs; then each group of RG query rows (a token's query heads that
// read this KV head, then the next token's) walks the key tiles it may see, with an online softmax and its
// output rows held in registers. Scores are q . k * scale in float32, as SDPA computes them.
//
// The 16 lanes of a tile are one zmm register in AVX-512 builds and two ymm registers in AVX2 builds (`V16`
// below): the same arithmetic lane by lane and the same groups (4 query rows for head_dim 16 and 32, the
// GQA group of the bench model: 0.70 ms a layer at 256 tokens on AVX2 against 0.96 with groups of 2, which
// spill fewer registers but repeat the softmax bookkeeping).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec_math.h"

at::Tensor dequantize_blocks(const at::Tensor& cache, const std::vector<int64_t>& ids);  // kvferry_cpu.cpp

namespace {

constexpr int64_t KT = 16;  // keys per tile: one V16 of scores per query row

#ifdef KVFERRY_AVX512BF16
struct V16 {
  __m512 v;
};
inline V16 zero16() { return {_mm512_setzero_ps()}; }
inline V16 set16(float x) { return {_mm512_set1_ps(x)}; }
inline V16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store16(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 fmadd16(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 mul16(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 add16(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub16(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 exp_16(V16 a) { return {kvferry_cpu::exp16(a.v)}; }
inline float max16(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline float sum16(V16 a) { return _mm512_reduce_add_ps(a.v); }
using M16 = __mmask16;  // a lane mask
inline M16 first16(int64_t n) { return n >= KT ? (M16)0xFFFF : (M16)((1u << n) - 1); }
// lanes in m keep a, the others get `fill` (or 0)
inline V16 keep16(V16 a, M16 m, float fill) { return {_mm512_mask_mov_ps(_mm512_set1_ps(fill), m, a.v)}; }
inline V16 keepz16(V16 a, M16 m) { return {_mm512_maskz_mov_ps(m, a.v)}; }
#else
struct V16 {
  __m256 lo, hi;
};
inline V16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store16(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 fmadd16(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 mul16(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 add16(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 sub16(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 exp_16(V16 a) { return {kvferry_cpu::exp8(a.lo), kvferry_cpu::exp8(a.hi)}; }
inline float hmax8(__m256 a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float max16(V16 a) { return hmax8(_mm256_max_ps(a.lo, a.hi)); }
inline float sum16(V16 a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
struct M16 {  // a lane mask: all ones / zero per float lane
  __m256 lo, hi;
};
inline M16 first16(int64_t n) {
  const __m256 idx = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  const __m256 limit = _mm256_set1_ps(static_cast<float>(std::min<int64_t>(n, KT)));
  return {_mm256_cmp_ps(idx, limit, _CMP_LT_OQ),
          _mm256_cmp_ps(_mm256_add_ps(idx, _mm256_set1_ps(8.f)), limit, _CMP_LT_OQ)};
}
// lanes in m keep a, the others get `fill` (or 0)
inline V16 keep16(V16 a, M16 m, float fill) {
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, a.lo, m.lo), _mm256_blendv_ps(f, a.hi, m.hi)};
}
inline V16 keepz16(V16 a, M16 m) { return {_mm256_and_ps(a.lo, m.lo), _mm256_and_ps(a.hi, m.hi)}; }
#endif

// RG query rows (pre-scaled q, [RG][D]), the last key index each may see (inclusive), over the key tiles of
// one KV head (kt: [tile][D][16], zero past the context) and its V rows (v + offsets[t]); out[r] gets row r.
template <int DV, int RG>
void attend_rows(const float* q, const int64_t* limit, const float* kt, const float* v, const int64_t* offsets,
                 float* const* out) {
  constexpr int64_t D = DV * 16;
  V16 o[RG][DV], total[RG];
  float peak[RG];
  alignas(64) float p[RG][KT];
  int64_t last = 0;
  for (int r = 0; r < RG; ++r) {
    for (int c = 0; c < DV; ++c) o[r][c] = zero16();
    total[r] = zero16();
    peak[r] = -INFINITY;
    last = std::max(last, limit[r]);
  }
  for (int64_t base = 0; base <= last; base += KT) {
    const float* tile = kt + base * D;
    V16 s[RG];
    for (int r = 0; r < RG; ++r) s[r] = zero16();
    for (int64_t c = 0; c < D; ++c) {
      const V16 k = load16(tile + c * KT);
      for (int r = 0; r < RG; ++r) s[r] = fmadd16(set16(q[r * D + c]), k, s[r]);
    }
    for (int r = 0; r < RG; ++r) {
      const int64_t visible = std::min<int64_t>(KT, limit[r] - base + 1);
      if (visible <= 0) {
        store16(p[r], zero16());
        continue;
      }
      const M16 valid = first16(visible);
      const V16 sv = keep16(s[r], valid, -INFINITY);
      const float high = max16(sv);
      if (high > peak[r]) {  // rescale what was summed under the old peak
        const V16 corr = set16(std::exp(peak[r] - high));
        for (int c = 0; c < DV; ++c) o[r][c] = mul16(o[r][c], corr);
        total[r] = mul16(total[r], corr);
        peak[r] = high;
      }
      const V16 e = keepz16(exp_16(sub16(sv, set16(peak[r]))), valid);
      total[r] = add16(total[r], e);
      store16(p[r], e);
    }
    const int64_t keys = std::min<int64_t>(KT, last - base + 1);
    for (int64_t i = 0; i < keys; ++i) {
      const float* row = v + offsets[base + i];
      V16 vv[DV];
      for (int c = 0; c < DV; ++c) vv[c] = load16(row + c * 16);
      for (int r = 0; r < RG; ++r) {
        const V16 w = set16(p[r][i]);
        for (int c = 0; c < DV; ++c) o[r][c] = fmadd16(w, vv[c], o[r][c]);
      }
    }
  }
  for (int r = 0; r < RG; ++r) {
    const V16 inv = set16(1.f / sum16(total[r]));
    for (int c = 0; c < DV; ++c) store16(out[r] + c * 16, mul16(o[r][c], inv));
  }
}

template <int DV, int RG>
void attend_chunk(const float* qp, int64_t q_stride, int64_t T, int64_t hq, int64_t hkv, const float* kt,
                  int64_t tiles, const float* vc, int64_t head_stride, const int64_t* offsets, int64_t context_len,
                  float scale, float* op) {
  constexpr int64_t D = DV * 16;
  const int64_t group = hq / hkv, rows = T * group, groups = (rows + RG - 1) / RG;
  at::parallel_for(0, hkv * groups, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float q[RG * D], scratch[D];
    int64_t limit[RG];
    float* out[RG];
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t h = item / groups, first = item % groups * RG;
      for (int64_t r = 0; r < RG; ++r) {
        const int64_t row = std::min(first + r, rows - 1), t = row / group, head = h * group + row % group;
        const float* src = qp + t * q_stride + head * D;
        for (int64_t c = 0; c < D; ++c) q[r * D + c] = src[c] * scale;
        limit[r] = context_len - T + t;
        out[r] = first + r < rows ? op + (t * hq + head) * D : scratch;  // a short last group: discarded
      }
      attend_rows<DV, RG>(q, limit, kt + h * tiles * KT * D, vc + h * head_stride, offsets, out);
    }
  });
}

}  // namespace

// q [T, Hq, D] (rows may be strided, D contiguous): the chunk's queries at positions context_len - T ..
// context_len - 1; caches [Hkv, num_blocks, bs, D] already holding the chunk's own K/V; block_table [W] the
// sequence's block ids. Returns [T, Hq * D].
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table_, int64_t context_len, double scale) {
  if (k_cache.scalar_type() == at::kChar) {  // int8 cache: the sequence's blocks, dequantized once
    auto table = block_table_.to(at::kLong).contiguous();
    const int64_t n = std::min<int64_t>(table.size(0), (context_len + k_cache.size(2) - 1) / k_cache.size(2));
    std::vector<int64_t> ids(table.data_ptr<int64_t>(), table.data_ptr<int64_t>() + n);
    return paged_prefill_attention(q, dequantize_blocks(k_cache, ids), dequantize_blocks(v_cache, ids),
                                   at::arange(n, table.options()), context_len, scale);
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat, "float32 q and caches only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [T, Hq, D], heads dense");
  const int64_t T = q.size(0), hq = q.size(1), D = q.size(2), hkv = k_cache.size(0), num_blocks = k_cache.size(1),
                bs = k_cache.size(2), DV = D / 16;
  auto block_table = block_table_.to(at::kLong).contiguous();
  TORCH_CHECK(D % 16 == 0 && (DV == 1 || DV == 2 || DV == 4 || DV == 8), "head_dim must be 16, 32, 64 or 128");
  TORCH_CHECK(hq % hkv == 0 && T <= context_len && context_len <= block_table.size(0) * bs, "bad chunk shape");
  auto out = at::empty({T, hq * D}, q.options());
  if (T == 0) return out;
  const int64_t* bt = block_table.data_ptr<int64_t>();
  std::vector<int64_t> offsets(context_len);  // each key's float offset within one head of the cache
  for (int64_t t = 0; t < context_len; ++t) offsets[t] = (bt[t / bs] * bs + t % bs) * D;
  const int64_t tiles = (context_len + KT - 1) / KT, head_stride = num_blocks * bs * D;
  auto kt = at::empty({hkv, tiles, D, KT}, q.options());  // every head's keys, transposed in tiles of 16
  const float* kc = k_cache.data_ptr<float>();
  float* ktp = kt.data_ptr<float>();
  at::parallel_for(0, hkv * tiles, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t h = item / tiles, base = item % tiles * KT;
      float* tile = ktp + item * D * KT;
      for (int64_t i = 0; i < KT; ++i) {
        const float* row = base + i < context_len ? kc + h * head_stride + offsets[base + i] : nullptr;
        for (int64_t c = 0; c < D; ++c) tile[c * KT + i] = row ? row[c] : 0.f;
      }
    }
  });
  const float *qp = q.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const int64_t qs = q.stride(0);
  switch (DV) {
    case 1: attend_chunk<1, 4>(qp, qs, T, hq, hkv, ktp, tiles, vc, head_stride, offsets.data(), context_len, s, op); break;
    case 2: attend_chunk<2, 4>(qp, qs, T, hq, hkv, ktp, tiles, vc, head_stride, offsets.data(), context_len, s, op); break;
    case 4: attend_chunk<4, 2>(qp, qs, T, hq, hkv, ktp, tiles, vc, head_stride, offsets.data(), context_len, s, op); break;
    default: attend_chunk<8, 1>(qp, qs, T, hq, hkv, ktp, tiles, vc, head_stride, offsets.data(), context_len, s, op);
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(kvferry_cpu, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int context_len, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvferry_cpu, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
