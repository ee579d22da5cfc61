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
//
// With `bf16` (a model whose GEMMs run in bf16) on a CPU where the brgemm path is on (AMX: brgemm.h), QK^T
// and PV are bf16 products through oneDNN's microkernel instead (`attend_brgemm`): each KV head's keys and
// values rounded to bf16 once per call, in the VNNI layouts the microkernel reads, then blocks of 32 query
// rows against blocks of 64 keys, the scores, masking and online softmax in float32. Elsewhere `bf16` changes
// nothing: the float32 kernel serves.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "brgemm.h"
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
inline float max16(V16 a) { return kvferry_cpu::hmax8(_mm256_max_ps(a.lo, a.hi)); }
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

// ---- bf16 products through brgemm (AMX) ----

constexpr int64_t BK = 64;  // keys per block: N of QK^T, K of PV (oneDNN's N block is at most 64)
constexpr int64_t BQ = 32;  // query rows per block: M of both

// float32 -> bf16 bits, round to nearest even (NaN stays a NaN), as torch's conversion
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline uint32_t bf16_pair(float lo, float hi) { return bf16_bits(lo) | (static_cast<uint32_t>(bf16_bits(hi)) << 16); }

// Every head's keys and values in bf16, per block of BK keys (zero past the context, so a block's padding
// adds nothing): keys as B of QK^T, [D/2][BK][2] (key n's dims 2p, 2p+1 side by side); values as B of PV,
// nv chunks of NV columns, each [BK/2][NV][2] (keys 2p, 2p+1 of one column side by side).
void pack_kv_bf16(const float* kc, const float* vc, int64_t hkv, int64_t head_stride, const int64_t* offsets,
                  int64_t context_len, int64_t D, int64_t NV, int64_t kblocks, uint32_t* kp, uint32_t* vp) {
  const int64_t block_words = D * BK / 2;  // uint32 words per block of keys (or of values)
  at::parallel_for(0, hkv * kblocks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t h = item / kblocks, base = item % kblocks * BK;
      uint32_t *kb = kp + item * block_words, *vb = vp + item * block_words;
      const float* khead = kc + h * head_stride;
      const float* vhead = vc + h * head_stride;
      for (int64_t n = 0; n < BK; ++n) {
        const float* row = base + n < context_len ? khead + offsets[base + n] : nullptr;
        for (int64_t p = 0; p < D / 2; ++p) kb[p * BK + n] = row ? bf16_pair(row[2 * p], row[2 * p + 1]) : 0u;
      }
      for (int64_t p = 0; p < BK / 2; ++p) {
        const int64_t t0 = base + 2 * p, t1 = t0 + 1;
        const float* r0 = t0 < context_len ? vhead + offsets[t0] : nullptr;
        const float* r1 = t1 < context_len ? vhead + offsets[t1] : nullptr;
        for (int64_t c = 0; c < D / NV; ++c)
          for (int64_t n = 0; n < NV; ++n) {
            const int64_t col = c * NV + n;
            vb[c * (BK / 2) * NV + p * NV + n] = bf16_pair(r0 ? r0[col] : 0.f, r1 ? r1[col] : 0.f);
          }
      }
    }
  });
}

// The paged prefill attention with bf16 QK^T and PV (see the top of the file); the arguments as attend_chunk's,
// plus the raw K cache (not transposed) and the head dim.
void attend_brgemm(const float* qp, int64_t q_stride, int64_t T, int64_t hq, int64_t hkv, int64_t D, const float* kc,
                   const float* vc, int64_t head_stride, const int64_t* offsets, int64_t context_len, float scale,
                   float* op) {
  using at::native::cpublas::brgemm;
  const int64_t NV = std::min<int64_t>(D, 64), kblocks = (context_len + BK - 1) / BK, block_words = D * BK / 2;
  auto packed = at::empty({2, hkv * kblocks * block_words}, at::kInt);
  uint32_t* kp = reinterpret_cast<uint32_t*>(packed[0].data_ptr<int32_t>());
  uint32_t* vp = reinterpret_cast<uint32_t*>(packed[1].data_ptr<int32_t>());
  pack_kv_bf16(kc, vc, hkv, head_stride, offsets, context_len, D, NV, kblocks, kp, vp);
  const int64_t group = hq / hkv, rows = T * group, qblocks = (rows + BQ - 1) / BQ;
  at::parallel_for(0, hkv * qblocks, 1, [&](int64_t i0, int64_t i1) {
    kvferry_cpu::BrgemmRelease release;  // this thread's tiles, on every way out
    std::vector<at::BFloat16> qb(BQ * D);
    std::vector<float> o(BQ * D);
    alignas(64) float s[BQ * BK];
    alignas(64) at::BFloat16 pb[BQ * BK];  // the padding rows of a short block: finite, their sums dropped
    std::fill(pb, pb + BQ * BK, at::BFloat16(0.f));
    float peak[BQ], total[BQ];
    int64_t limit[BQ];
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t h = item / qblocks, first = item % qblocks * BQ, nr = std::min(BQ, rows - first);
      const int64_t mr = kvferry_cpu::call_rows(nr);  // rows per call: a short last block is zero-padded
      std::fill(qb.begin() + nr * D, qb.begin() + mr * D, at::BFloat16(0.f));
      int64_t last = 0;
      for (int64_t r = 0; r < nr; ++r) {  // row r: token t's query head h * group + g
        const int64_t row = first + r, t = row / group, head = h * group + row % group;
        const float* src = qp + t * q_stride + head * D;
        for (int64_t c = 0; c < D; ++c) qb[r * D + c] = static_cast<at::BFloat16>(src[c] * scale);
        limit[r] = context_len - T + t;  // the last key it sees
        last = std::max(last, limit[r]);
        peak[r] = -INFINITY;
        total[r] = 0.f;
      }
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t kb = 0; kb <= last / BK; ++kb) {
        const int64_t base = kb * BK;
        const auto* keys = reinterpret_cast<const at::BFloat16*>(kp + (h * kblocks + kb) * block_words);
        brgemm(mr, BK, D, D, BK, BK, false, qb.data(), keys, s, true);  // s = q k^T
        for (int64_t r = 0; r < nr; ++r) {
          float* sr = s + r * BK;
          at::BFloat16* pr = pb + r * BK;
          const int64_t visible = std::min<int64_t>(BK, limit[r] - base + 1);
          if (visible <= 0) {
            std::fill(pr, pr + BK, at::BFloat16(0.f));
            continue;
          }
          const float high = *std::max_element(sr, sr + visible);
          if (high > peak[r]) {  // rescale what was summed under the old peak
            const float corr = std::exp(peak[r] - high);
            float* orow = o.data() + r * D;
            for (int64_t c = 0; c < D; ++c) orow[c] *= corr;
            total[r] *= corr;
            peak[r] = high;
          }
          const __m256 vp8 = _mm256_set1_ps(peak[r]);
          __m256 sum = _mm256_setzero_ps();
          for (int64_t i = 0; i < BK; i += 8) {
            const __m256 idx = _mm256_add_ps(_mm256_set1_ps(static_cast<float>(i)),
                                             _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f));
            const __m256 keep = _mm256_cmp_ps(idx, _mm256_set1_ps(static_cast<float>(visible)), _CMP_LT_OQ);
            const __m256 e = _mm256_and_ps(kvferry_cpu::exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + i), vp8)), keep);
            _mm256_storeu_ps(sr + i, e);
            sum = _mm256_add_ps(sum, e);
          }
          alignas(32) float lanes[8];
          _mm256_store_ps(lanes, sum);
          for (float lane : lanes) total[r] += lane;
          for (int64_t i = 0; i < BK; ++i) pr[i] = static_cast<at::BFloat16>(sr[i]);
        }
        const uint32_t* vblock = vp + (h * kblocks + kb) * block_words;
        for (int64_t c = 0; c < D / NV; ++c)  // o += P V, a chunk of NV columns at a time
          brgemm(mr, NV, BK, BK, NV, D, true, pb, reinterpret_cast<const at::BFloat16*>(vblock + c * (BK / 2) * NV),
                 o.data() + c * NV, true);
      }
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t row = first + r, t = row / group, head = h * group + row % group;
        const float inv = 1.f / total[r];
        float* dst = op + (t * hq + head) * D;
        for (int64_t c = 0; c < D; ++c) dst[c] = o[r * D + c] * inv;
      }
    }
  });
}

}  // namespace

// q [T, Hq, D] (rows may be strided, D contiguous): the chunk's queries at positions context_len - T ..
// context_len - 1; caches [Hkv, num_blocks, bs, D] already holding the chunk's own K/V; block_table [W] the
// sequence's block ids. Returns [T, Hq * D]. bf16: QK^T and PV may run as bf16 products (where the brgemm
// path is on: AMX), for a model whose GEMMs are bf16 anyway; float32 otherwise.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_table_, int64_t context_len, double scale, bool bf16) {
  if (k_cache.scalar_type() == at::kChar) {  // int8 cache: the sequence's blocks, dequantized once
    auto table = block_table_.to(at::kLong).contiguous();
    const int64_t n = std::min<int64_t>(table.size(0), (context_len + k_cache.size(2) - 1) / k_cache.size(2));
    std::vector<int64_t> ids(table.data_ptr<int64_t>(), table.data_ptr<int64_t>() + n);
    return paged_prefill_attention(q, dequantize_blocks(k_cache, ids), dequantize_blocks(v_cache, ids),
                                   at::arange(n, table.options()), context_len, scale, bf16);
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
  if (bf16 && kvferry_cpu::brgemm_serves(T * (hq / hkv))) {  // as many query rows as a GEMM's that takes it
    attend_brgemm(q.data_ptr<float>(), q.stride(0), T, hq, hkv, D, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                  head_stride, offsets.data(), context_len, static_cast<float>(scale), out.data_ptr<float>());
    return out;
  }
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
        "float scale, bool bf16=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvferry_cpu, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
