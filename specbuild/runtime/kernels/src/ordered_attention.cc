// Attention over the KV cache whose every query row gets the same bits whatever the call's other rows and whatever
// cache columns its keys sit in: the keys a row sees are reduced one after the other in column order, which for
// every row of an engine call is position order (the cache, then the row's tree ancestors). A tree node verified in
// one call thus computes exactly what one-token decoding computes for the same token, and speculation with branching
// trees stays bit-exact where the roundings that follow attention (int8 activations, an int8 cache) would otherwise
// turn last-bit differences into other tokens.
//
// Ops specbuild.kernels/OrderedAttention (float cache) and OrderedAttentionInt8 (int8 cache, one scale per tensor)
// take GroupQueryAttention's inputs at the same positions -- packed QKV [B, T, (Hq + 2 Hkv) D], past key/value
// [B, Hkv, C, D] (the buffers the runtime binds in place as the present outputs), seqlens_k [B] (= past + T - 1),
// total_sequence_length, cos/sin caches [P, R/2], optional position_ids [B, T], optional additive attention_bias
// [B|1, 1, T, >= past + T], k_scale / v_scale for the int8 cache -- and give its outputs: attention [B, T, Hq D] and
// the present key/value buffers with the T new keys (rotated, rotate-half over the first R dims) and values written
// at columns [past, past + T). Without a bias the new tokens are a causal chain (key column j visible to row i when
// j <= past + i, and j > past + i - local_window_size where a window is set).
//
// Per query row and head, over the visible columns j in column order: s_j = dot(q, k_j) * scale (k_j as stored, an
// int8 key's scale folded into `scale`; the dot as 16 lanes of fma over the head's dims, lane l + lane l + 8, then
// those 8 summed pairwise), softcapped where set, plus the bias; m = max s_j; p_j = Exp(s_j - m) (a polynomial of
// our own, the same bits on every path, see Exp); their sum one after the other; out = (sum_j p_j v_j: the terms of
// the even and of the odd visible columns each accumulated in order, one fma per term, then added) * (v scale / sum).
// Every step is a function of the list of visible (key, value) pairs alone, which is the same list for a tree node
// and for its token decoded alone. One pass of the keys scores 8 columns at a time; the values are summed 32 dims at
// a time; the query heads of one kv head take each block of keys and of values in turn while it is in cache (the
// cache is read once per kv head, not once per query head). The AVX2 path (taken by AVX-512 CPUs too) and the plain
// C++ one do the same operations.
//
// Built by specbuild/runtime/kernels/build.py (docs/engine-format.md).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"

namespace specbuild_kernels {
namespace {


struct Attend {
  int64_t batch = 0, tokens = 0, heads = 0, kv_heads = 0, dim = 0, capacity = 0, half = 0, positions = 0;
  const float* qkv = nullptr;         // [B, T, (Hq + 2 Hkv) D]
  const float* cos = nullptr;         // [P, half]
  const float* sin = nullptr;         // [P, half]
  const int64_t* position_ids = nullptr;  // [B, T] or null: past + i
  const float* bias = nullptr;        // [Bb, 1, T, bias_cols] or null: a causal chain
  int64_t bias_batch = 0, bias_cols = 0;
  std::vector<int64_t> past;          // [B]
  void* keys = nullptr;               // present key [B, Hkv, C, D], float or int8
  void* values = nullptr;
  bool int8 = false;
  float k_scale = 1.0f, v_scale = 1.0f;
  float scale = 0.0f, softcap = 0.0f;
  int64_t window = -1;
  float* out = nullptr;               // [B, T, Hq D]

  int64_t Width() const { return (heads + 2 * kv_heads) * dim; }
  int64_t Position(int64_t b, int64_t i) const { return position_ids ? position_ids[b * tokens + i] : past[b] + i; }
  size_t Slot(int64_t b, int64_t g, int64_t column) const {
    return static_cast<size_t>(((b * kv_heads + g) * capacity + column) * dim);
  }
};

// x rotated at `position` (rotate-half over the first 2 * half dims), written to `out`.
inline __attribute__((always_inline)) void Rotate(const Attend& a, const float* x, int64_t position, float* out) {
  const float* c = a.cos + position * a.half;
  const float* s = a.sin + position * a.half;
  for (int64_t d = 0; d < a.half; ++d) {
    float x1 = x[d], x2 = x[d + a.half];
    out[d] = x1 * c[d] - x2 * s[d];
    out[d + a.half] = x2 * c[d] + x1 * s[d];
  }
  for (int64_t d = 2 * a.half; d < a.dim; ++d) out[d] = x[d];
}

inline int8_t Quantize(float x, float scale) {
  float q = std::nearbyint(x / scale);  // round half to even (the default rounding mode)
  return static_cast<int8_t>(std::fmin(127.0f, std::fmax(-128.0f, q)));
}

// The new tokens' rotated keys and values into the present buffers at [past, past + T).
void WriteNew(const Attend& a) {
  std::vector<float> rotated(static_cast<size_t>(a.dim));
  for (int64_t b = 0; b < a.batch; ++b) {
    for (int64_t i = 0; i < a.tokens; ++i) {
      const float* row = a.qkv + (b * a.tokens + i) * a.Width();
      for (int64_t g = 0; g < a.kv_heads; ++g) {
        const float* k = row + (a.heads + g) * a.dim;
        const float* v = row + (a.heads + a.kv_heads + g) * a.dim;
        Rotate(a, k, a.Position(b, i), rotated.data());
        size_t slot = a.Slot(b, g, a.past[b] + i);
        if (a.int8) {
          int8_t* kq = static_cast<int8_t*>(a.keys) + slot;
          int8_t* vq = static_cast<int8_t*>(a.values) + slot;
          for (int64_t d = 0; d < a.dim; ++d) {
            kq[d] = Quantize(rotated[d], a.k_scale);
            vq[d] = Quantize(v[d], a.v_scale);
          }
        } else {
          std::memcpy(static_cast<float*>(a.keys) + slot, rotated.data(), sizeof(float) * a.dim);
          std::memcpy(static_cast<float*>(a.values) + slot, v, sizeof(float) * a.dim);
        }
      }
    }
  }
}

// 8 float lanes, one type per instruction set (AVX2 with FMA; plain C++), with the same roundings lane for lane:
// every kernel below is written once over them.
struct Scalar8 {
  float v[8];
  static Scalar8 Set(float x) {
    Scalar8 r;
    for (int l = 0; l < 8; ++l) r.v[l] = x;
    return r;
  }
  static Scalar8 Load(const float* p) {
    Scalar8 r;
    for (int l = 0; l < 8; ++l) r.v[l] = p[l];
    return r;
  }
  static Scalar8 Load(const int8_t* p) {
    Scalar8 r;
    for (int l = 0; l < 8; ++l) r.v[l] = static_cast<float>(p[l]);
    return r;
  }
  void Store(float* p) const {
    for (int l = 0; l < 8; ++l) p[l] = v[l];
  }
#define SPECBUILD_LANEWISE(name, expr)                 \
  static Scalar8 name(const Scalar8& a, const Scalar8& b) { \
    Scalar8 r;                                         \
    for (int l = 0; l < 8; ++l) r.v[l] = expr;         \
    return r;                                          \
  }
  SPECBUILD_LANEWISE(Add, a.v[l] + b.v[l])
  SPECBUILD_LANEWISE(Mul, a.v[l] * b.v[l])
  SPECBUILD_LANEWISE(Max, a.v[l] > b.v[l] ? a.v[l] : b.v[l])  // b where a is NaN, as maxps
#undef SPECBUILD_LANEWISE
  static Scalar8 Fma(const Scalar8& a, const Scalar8& b, const Scalar8& c) {
    Scalar8 r;
    for (int l = 0; l < 8; ++l) r.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
    return r;
  }
  static Scalar8 Round(const Scalar8& a) {  // to nearest, ties to even
    Scalar8 r;
    for (int l = 0; l < 8; ++l) r.v[l] = std::nearbyint(a.v[l]);
    return r;
  }
  static Scalar8 Pow2(const Scalar8& n) {  // 2^n for integral n in [-126, 127]
    Scalar8 r;
    for (int l = 0; l < 8; ++l) {
      int32_t bits = (static_cast<int32_t>(n.v[l]) + 127) << 23;
      std::memcpy(&r.v[l], &bits, sizeof(float));
    }
    return r;
  }
  // Lane c of the result: the sum of the 8 lanes of x[c], as ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)).
  static Scalar8 Sums(const Scalar8* x) {
    Scalar8 r;
    for (int c = 0; c < 8; ++c) {
      const float* v = x[c].v;
      r.v[c] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    }
    return r;
  }
};

#define SPECBUILD_AVX2 __attribute__((target("avx2,fma"))) inline
struct Avx2x8 {
  __m256 v;
  SPECBUILD_AVX2 static Avx2x8 Set(float x) { return {_mm256_set1_ps(x)}; }
  SPECBUILD_AVX2 static Avx2x8 Load(const float* p) { return {_mm256_loadu_ps(p)}; }
  SPECBUILD_AVX2 static Avx2x8 Load(const int8_t* p) {
    return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))};
  }
  SPECBUILD_AVX2 void Store(float* p) const { _mm256_storeu_ps(p, v); }
  SPECBUILD_AVX2 static Avx2x8 Add(const Avx2x8& a, const Avx2x8& b) { return {_mm256_add_ps(a.v, b.v)}; }
  SPECBUILD_AVX2 static Avx2x8 Mul(const Avx2x8& a, const Avx2x8& b) { return {_mm256_mul_ps(a.v, b.v)}; }
  SPECBUILD_AVX2 static Avx2x8 Max(const Avx2x8& a, const Avx2x8& b) { return {_mm256_max_ps(a.v, b.v)}; }
  SPECBUILD_AVX2 static Avx2x8 Fma(const Avx2x8& a, const Avx2x8& b, const Avx2x8& c) {
    return {_mm256_fmadd_ps(a.v, b.v, c.v)};
  }
  SPECBUILD_AVX2 static Avx2x8 Round(const Avx2x8& a) {
    return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  SPECBUILD_AVX2 static Avx2x8 Pow2(const Avx2x8& n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(e, 23))};
  }
  SPECBUILD_AVX2 static Avx2x8 Sums(const Avx2x8* x) {
    __m256 a01 = _mm256_hadd_ps(x[0].v, x[1].v), a23 = _mm256_hadd_ps(x[2].v, x[3].v);
    __m256 a45 = _mm256_hadd_ps(x[4].v, x[5].v), a67 = _mm256_hadd_ps(x[6].v, x[7].v);
    __m256 b0 = _mm256_hadd_ps(a01, a23), b1 = _mm256_hadd_ps(a45, a67);  // lanes 0-3 + lanes 4-7 below
    return {_mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31))};
  }
};

// exp(x) for x <= 0 (softmax's exponents): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial, times
// 2^n; below -87.3 (where expf's result leaves the normal floats) as at -87.3. Within 2 ulp of exp.
template <typename V>
inline __attribute__((always_inline)) V Exp(V x) {
  x = V::Max(x, V::Set(-87.3f));
  V n = V::Round(V::Mul(x, V::Set(1.44269504088896341f)));
  V r = V::Fma(n, V::Set(-0.693359375f), x);
  r = V::Fma(n, V::Set(2.12194440e-4f), r);
  V p = V::Set(1.9875691500e-4f);
  p = V::Fma(p, r, V::Set(1.3981999507e-3f));
  p = V::Fma(p, r, V::Set(8.3334519073e-3f));
  p = V::Fma(p, r, V::Set(4.1665795894e-2f));
  p = V::Fma(p, r, V::Set(1.6666665459e-1f));
  p = V::Fma(p, r, V::Set(5.0000001201e-1f));
  V y = V::Add(V::Fma(p, V::Mul(r, r), r), V::Set(1.0f));
  return V::Mul(y, V::Pow2(n));
}

// The columns row (b, i) sees, in order, and their biases (none: a causal chain).
inline void Visible(const Attend& a, int64_t b, int64_t i, std::vector<int32_t>& columns, std::vector<float>& bias) {
  columns.clear();
  bias.clear();
  int64_t end = a.past[b] + a.tokens;
  if (a.bias != nullptr) {
    const float* row = a.bias + ((a.bias_batch == 1 ? 0 : b) * a.tokens + i) * a.bias_cols;
    for (int64_t j = 0; j < end; ++j) {
      if (row[j] == -std::numeric_limits<float>::infinity()) continue;
      columns.push_back(static_cast<int32_t>(j));
      bias.push_back(row[j]);
    }
    return;
  }
  int64_t last = a.past[b] + i;
  int64_t first = a.window > 0 ? std::max<int64_t>(0, last - a.window + 1) : 0;
  for (int64_t j = first; j <= last; ++j) columns.push_back(static_cast<int32_t>(j));
}

// Columns [n_begin, n_end) of the sum over the visible columns n of p[n] v_n, dims [d0, d0 + 8 L): the terms of even
// and of odd n each added in order by one fma per term onto the running sums even / odd (2 L chains, kept in memory
// between calls: a call's block starts at an even n, so the chains are those of one pass over every column).
template <typename V, typename T, int L>
inline void AccumulateValues(const Attend& a, const T* values, int64_t b, int64_t g, const int32_t* columns,
                             const float* p, int64_t n_begin, int64_t n_end, int64_t d0, float* even_sums,
                             float* odd_sums) {
  V even[L], odd[L];
  for (int l = 0; l < L; ++l) {
    even[l] = V::Load(even_sums + d0 + 8 * l);
    odd[l] = V::Load(odd_sums + d0 + 8 * l);
  }
  int64_t n = n_begin;
  for (; n + 2 <= n_end; n += 2) {
    const T* v0 = values + a.Slot(b, g, columns[n]) + d0;
    const T* v1 = values + a.Slot(b, g, columns[n + 1]) + d0;
    const V w0 = V::Set(p[n]), w1 = V::Set(p[n + 1]);
    for (int l = 0; l < L; ++l) {
      even[l] = V::Fma(w0, V::Load(v0 + 8 * l), even[l]);
      odd[l] = V::Fma(w1, V::Load(v1 + 8 * l), odd[l]);
    }
  }
  if (n < n_end) {
    const T* v0 = values + a.Slot(b, g, columns[n]) + d0;
    const V w0 = V::Set(p[n]);
    for (int l = 0; l < L; ++l) even[l] = V::Fma(w0, V::Load(v0 + 8 * l), even[l]);
  }
  for (int l = 0; l < L; ++l) {
    even[l].Store(even_sums + d0 + 8 * l);
    odd[l].Store(odd_sums + d0 + 8 * l);
  }
}

// scores[n0, n0 + count) of one query head q over 8 (or the last count) visible columns: per column, 16 dot-product
// lanes (lane l: fma over d = l mod 16, in order of d; lanes l and l + 8 added, then the 8 sums as in V::Sums) times
// scale.
template <typename V, typename T>
inline void ScoreBlock(const Attend& a, const float* q, const T* keys, int64_t b, int64_t g, const int32_t* columns,
                       int64_t n0, int64_t count, float scale, float* scores) {
  V partial[8];
  for (int64_t c0 = 0; c0 < 8; c0 += 4) {  // 4 columns at a time: 8 independent fma chains
    const T* k[4];
    for (int c = 0; c < 4; ++c) k[c] = keys + a.Slot(b, g, columns[n0 + std::min<int64_t>(c0 + c, count - 1)]);
    V lo[4], hi[4];  // lanes 0-7 and 8-15 of each 16 dims
    for (int c = 0; c < 4; ++c) lo[c] = hi[c] = V::Set(0.0f);
    for (int64_t d = 0; d < a.dim; d += 16) {
      const V q_lo = V::Load(q + d), q_hi = V::Load(q + d + 8);
      for (int c = 0; c < 4; ++c) {
        lo[c] = V::Fma(q_lo, V::Load(k[c] + d), lo[c]);
        hi[c] = V::Fma(q_hi, V::Load(k[c] + d + 8), hi[c]);
      }
    }
    for (int c = 0; c < 4; ++c) partial[c0 + c] = c0 + c < count ? V::Add(lo[c], hi[c]) : V::Set(0.0f);
  }
  float block[8];
  V::Mul(V::Sums(partial), V::Set(scale)).Store(block);
  std::memcpy(scores + n0, block, sizeof(float) * count);
}

// Columns per block of the value pass: every query head of a kv head sums a block's values while they are in the
// core's nearest cache (even, so that each block starts on an even column: the chains of AccumulateValues).
constexpr int64_t kValueBlock = 64;

// The query heads `q` [group][dim] (rotated) of row (b, i) over the columns it sees, every head the arithmetic of the
// file's comment: scores as in ScoreBlock, softcapped, plus the bias; p[n] = Exp(scores[n] - max), their sum in
// column order; out = (sum over n of p[n] v_n, fma in column order) / sum. The heads share each block of keys and
// of values while it is in cache (each head's arithmetic is its own: the same bits as one head at a time).
template <typename V, typename T>
inline void AttendGroup(const Attend& a, const float* q, int64_t group, const T* keys, const T* values, int64_t b,
                        int64_t g, const std::vector<int32_t>& columns, const std::vector<float>& bias,
                        std::vector<float>& scores, std::vector<float>& sums, float* out) {
  const int64_t n_cols = static_cast<int64_t>(columns.size()), dim = a.dim;
  const float scale = a.scale * (a.int8 ? a.k_scale : 1.0f);
  scores.resize(static_cast<size_t>(group * n_cols));
  sums.assign(static_cast<size_t>(group * 2 * dim), 0.0f);
  for (int64_t n0 = 0; n0 < n_cols; n0 += 8) {
    const int64_t count = std::min<int64_t>(8, n_cols - n0);
    for (int64_t h = 0; h < group; ++h)
      ScoreBlock<V, T>(a, q + h * dim, keys, b, g, columns.data(), n0, count, scale, scores.data() + h * n_cols);
  }
  thread_local std::vector<float> norm;
  norm.resize(static_cast<size_t>(group));
  for (int64_t h = 0; h < group; ++h) {
    float* s = scores.data() + h * n_cols;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t n = 0; n < n_cols; ++n) {
      if (a.softcap > 0.0f) s[n] = a.softcap * std::tanh(s[n] / a.softcap);
      if (!bias.empty()) s[n] += bias[n];
      top = s[n] > top ? s[n] : top;
    }
    float sum = 0.0f;
    for (int64_t n0 = 0; n0 < n_cols; n0 += 8) {
      float block[8] = {0.0f};
      const int64_t count = std::min<int64_t>(8, n_cols - n0);
      std::memcpy(block, s + n0, sizeof(float) * count);
      Exp(V::Add(V::Load(block), V::Set(-top))).Store(block);  // s - top: exact as an add of -top
      for (int64_t c = 0; c < count; ++c) sum += block[c];
      std::memcpy(s + n0, block, sizeof(float) * count);
    }
    norm[static_cast<size_t>(h)] = (a.int8 ? a.v_scale : 1.0f) / sum;
  }
  for (int64_t n0 = 0; n0 < n_cols; n0 += kValueBlock) {
    const int64_t n1 = std::min(n_cols, n0 + kValueBlock);
    for (int64_t h = 0; h < group; ++h) {
      const float* p = scores.data() + h * n_cols;
      float* even = sums.data() + h * 2 * dim;
      float* odd = even + dim;
      int64_t d0 = 0;
      for (; d0 + 32 <= dim; d0 += 32)
        AccumulateValues<V, T, 4>(a, values, b, g, columns.data(), p, n0, n1, d0, even, odd);
      if (d0 < dim)  // dim % 32 == 16
        AccumulateValues<V, T, 2>(a, values, b, g, columns.data(), p, n0, n1, d0, even, odd);
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* o = out + h * dim;
    if (n_cols == 0) {
      std::fill(o, o + dim, 0.0f);
      continue;
    }
    const float* even = sums.data() + h * 2 * dim;
    const V scale_by = V::Set(norm[static_cast<size_t>(h)]);
    for (int64_t d = 0; d < dim; d += 8)
      V::Mul(V::Add(V::Load(even + d), V::Load(even + dim + d)), scale_by).Store(o + d);
  }
}

// One task: query row (b, i) for the query heads of kv head g.
template <typename V, typename T>
inline void AttendRow(const Attend& a, int64_t task) {
  int64_t g = task % a.kv_heads, i = (task / a.kv_heads) % a.tokens, b = task / (a.kv_heads * a.tokens);
  thread_local std::vector<int32_t> columns;
  thread_local std::vector<float> bias, scores, sums, q;
  Visible(a, b, i, columns, bias);
  const int64_t group = a.heads / a.kv_heads;
  q.resize(static_cast<size_t>(group * a.dim));
  const float* row = a.qkv + (b * a.tokens + i) * a.Width();
  float* out = a.out + (b * a.tokens + i) * a.heads * a.dim;
  for (int64_t h = 0; h < group; ++h) Rotate(a, row + (g * group + h) * a.dim, a.Position(b, i), q.data() + h * a.dim);
  AttendGroup<V, T>(a, q.data(), group, static_cast<const T*>(a.keys), static_cast<const T*>(a.values), b, g, columns,
                    bias, scores, sums, out + g * group * a.dim);
}

template <typename V>
inline void AttendAny(const Attend& a, int64_t task) {
  if (a.int8)
    AttendRow<V, int8_t>(a, task);
  else
    AttendRow<V, float>(a, task);
}

// flatten: the lanes' intrinsics are inlined into the function compiled for their instruction set. CPUs with
// AVX-512 take the AVX2 path: attention is not where their wider registers pay.
__attribute__((target("avx2,fma"), flatten)) void AttendAvx2(const Attend& a, int64_t task) {
  AttendAny<Avx2x8>(a, task);
}
__attribute__((flatten)) void AttendScalar(const Attend& a, int64_t task) { AttendAny<Scalar8>(a, task); }

struct Task {
  const Attend* attend;
  void (*fn)(const Attend&, int64_t);
};

void RunTask(void* data, size_t task) {
  const Task* t = static_cast<const Task*>(data);
  t->fn(*t->attend, static_cast<int64_t>(task));
}

const OrtValue* Input(OrtKernelContext* context, size_t index) {
  size_t count = 0;
  Ort::ThrowOnError(Ort::GetApi().KernelContext_GetInputCount(context, &count));
  if (index >= count) return nullptr;
  const OrtValue* value = nullptr;
  Ort::ThrowOnError(Ort::GetApi().KernelContext_GetInput(context, index, &value));
  return value;
}

std::vector<int64_t> Shape(const OrtValue* value) {
  return Ort::ConstValue(value).GetTensorTypeAndShapeInfo().GetShape();
}

struct OrderedAttentionKernel {
  OrderedAttentionKernel(const OrtKernelInfo* info, bool int8) : int8_(int8) {
    Ort::ConstKernelInfo kernel_info(info);
    heads_ = kernel_info.GetAttribute<int64_t>("num_heads");
    kv_heads_ = kernel_info.GetAttribute<int64_t>("kv_num_heads");
    scale_ = kernel_info.GetAttribute<float>("scale");
    softcap_ = kernel_info.GetAttribute<float>("softcap");
    window_ = kernel_info.GetAttribute<int64_t>("local_window_size");
    if (heads_ <= 0 || kv_heads_ <= 0 || heads_ % kv_heads_)
      throw std::runtime_error("OrderedAttention: num_heads must be a positive multiple of kv_num_heads");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Attend a;
    a.int8 = int8_;
    a.heads = heads_;
    a.kv_heads = kv_heads_;
    a.softcap = softcap_;
    a.window = window_;
    const OrtValue* qkv = Input(context, 0);
    const OrtValue* past_k = Input(context, 3);
    const OrtValue* past_v = Input(context, 4);
    const OrtValue* seqlens = Input(context, 5);
    const OrtValue* cos = Input(context, 7);
    const OrtValue* sin = Input(context, 8);
    if (!qkv || !past_k || !past_v || !seqlens || !cos || !sin)
      throw std::runtime_error("OrderedAttention: packed QKV, the past KV buffers, seqlens_k and cos/sin are needed");
    std::vector<int64_t> qkv_shape = Shape(qkv), kv_shape = Shape(past_k), cos_shape = Shape(cos);
    if (qkv_shape.size() != 3 || kv_shape.size() != 4 || cos_shape.size() != 2)
      throw std::runtime_error("OrderedAttention: QKV must be [B, T, W], the KV buffers [B, Hkv, C, D]");
    a.batch = qkv_shape[0];
    a.tokens = qkv_shape[1];
    a.dim = kv_shape[3];
    a.capacity = kv_shape[2];
    a.half = cos_shape[1];
    a.positions = cos_shape[0];
    if (kv_shape[0] != a.batch || kv_shape[1] != a.kv_heads || qkv_shape[2] != a.Width() || 2 * a.half > a.dim)
      throw std::runtime_error("OrderedAttention: QKV, KV buffer and rotary shapes disagree");
    if (a.dim % 16) throw std::runtime_error("OrderedAttention: the head size must be a multiple of 16");
    a.scale = scale_ > 0.0f ? scale_ : 1.0f / std::sqrt(static_cast<float>(a.dim));
    a.qkv = Ort::ConstValue(qkv).GetTensorData<float>();
    a.cos = Ort::ConstValue(cos).GetTensorData<float>();
    a.sin = Ort::ConstValue(sin).GetTensorData<float>();
    const int32_t* seq = Ort::ConstValue(seqlens).GetTensorData<int32_t>();
    a.past.resize(static_cast<size_t>(a.batch));
    for (int64_t b = 0; b < a.batch; ++b) {
      a.past[b] = static_cast<int64_t>(seq[b]) + 1 - a.tokens;
      if (a.past[b] < 0 || a.past[b] + a.tokens > a.capacity)
        throw std::runtime_error("OrderedAttention: seqlens_k places the new tokens outside the KV buffer");
    }
    if (const OrtValue* query_lens = Input(context, 16)) {
      const int32_t* lens = Ort::ConstValue(query_lens).GetTensorData<int32_t>();
      for (int64_t b = 0; b < a.batch; ++b)
        if (lens[b] != a.tokens) throw std::runtime_error("OrderedAttention: right-padded calls are not supported");
    }
    if (const OrtValue* ids = Input(context, 9)) a.position_ids = Ort::ConstValue(ids).GetTensorData<int64_t>();
    if (const OrtValue* bias = Input(context, 10)) {
      std::vector<int64_t> shape = Shape(bias);
      if (shape.size() != 4 || shape[2] != a.tokens || (shape[0] != 1 && shape[0] != a.batch))
        throw std::runtime_error("OrderedAttention: attention_bias must be [B or 1, 1, T, columns]");
      a.bias = Ort::ConstValue(bias).GetTensorData<float>();
      a.bias_batch = shape[0];
      a.bias_cols = shape[3];
      for (int64_t b = 0; b < a.batch; ++b)
        if (a.past[b] + a.tokens > a.bias_cols)
          throw std::runtime_error("OrderedAttention: attention_bias has fewer columns than past + T");
    }
    if (a.int8) {
      const OrtValue* ks = Input(context, 12);
      const OrtValue* vs = Input(context, 13);
      if (!ks || !vs) throw std::runtime_error("OrderedAttentionInt8: k_scale and v_scale are needed");
      a.k_scale = Ort::ConstValue(ks).GetTensorData<float>()[0];
      a.v_scale = Ort::ConstValue(vs).GetTensorData<float>()[0];
    }
    for (int64_t b = 0; b < a.batch && a.position_ids; ++b)
      for (int64_t i = 0; i < a.tokens; ++i)
        if (a.position_ids[b * a.tokens + i] < 0 || a.position_ids[b * a.tokens + i] >= a.positions)
          throw std::runtime_error("OrderedAttention: a position id lies outside the rotary tables");
    for (int64_t b = 0; b < a.batch && !a.position_ids; ++b)
      if (a.past[b] + a.tokens > a.positions)
        throw std::runtime_error("OrderedAttention: a position lies outside the rotary tables");

    Ort::UnownedValue out = ctx.GetOutput(0, {a.batch, a.tokens, a.heads * a.dim});
    Ort::UnownedValue present_k = ctx.GetOutput(1, kv_shape);
    Ort::UnownedValue present_v = ctx.GetOutput(2, kv_shape);
    a.out = out.GetTensorMutableData<float>();
    a.keys = present_k.GetTensorMutableRawData();
    a.values = present_v.GetTensorMutableRawData();
    size_t bytes = static_cast<size_t>(a.batch * a.kv_heads * a.capacity * a.dim) * (a.int8 ? 1 : sizeof(float));
    const void* past_keys = Ort::ConstValue(past_k).GetTensorRawData();
    const void* past_values = Ort::ConstValue(past_v).GetTensorRawData();
    if (a.keys != past_keys) std::memcpy(a.keys, past_keys, bytes);  // in place when the runtime binds one buffer
    if (a.values != past_values) std::memcpy(a.values, past_values, bytes);
    if (a.batch == 0 || a.tokens == 0) return;
    WriteNew(a);
    Isa isa = ChosenIsa();
    Task task{&a, isa == Isa::kScalar ? AttendScalar : AttendAvx2};
    // every task a batch of its own: the threads take them as they finish (a prompt's later rows see more keys)
    size_t tasks = static_cast<size_t>(a.batch * a.tokens * a.kv_heads);
    ctx.ParallelFor(RunTask, tasks, tasks, &task);
  }

 private:
  bool int8_;
  int64_t heads_ = 0, kv_heads_ = 0, window_ = -1;
  float scale_ = 0.0f, softcap_ = 0.0f;
};

template <bool kInt8>
struct OrderedAttentionOp : Ort::CustomOpBase<OrderedAttentionOp<kInt8>, OrderedAttentionKernel> {
  void* CreateKernel(const OrtApi& /*api*/, const OrtKernelInfo* info) const {
    return new OrderedAttentionKernel(info, kInt8);
  }
  const char* GetName() const { return kInt8 ? "OrderedAttentionInt8" : "OrderedAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 17; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    switch (index) {
      case 3:
      case 4:
        return kInt8 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
      case 5:
      case 6:
      case 16:
        return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
      case 9:
        return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
      default:
        return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    }
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    bool required = index == 0 || index == 3 || index == 4 || index == 5 || index == 6 || index == 7 || index == 8;
    return required ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t index) const {
    return index > 0 && kInt8 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

}  // namespace

void AddOrderedAttention(Ort::CustomOpDomain& domain) {
  static OrderedAttentionOp<false> float_cache;
  static OrderedAttentionOp<true> int8_cache;
  domain.Add(&float_cache);
  domain.Add(&int8_cache);
}

}  // namespace specbuild_kernels
