// specbuild's ONNX Runtime custom-operator library: a matmul with 4-bit block-quantized weights whose cost grows
// little with the rows of a call and whose every row gets the same bits whatever the call's other rows and whatever
// the CPU's instruction set.
//
// Op specbuild.kernels/BlockInt4MatMul(X float [..., K], W int4 [K, N] (symmetric, constant), S float [K/32, N]
// (constant)) -> Y float [..., N], the value of MatMul(X, DequantizeLinear(W, S, axis=0, block_size=32)):
// - int8_activations=1 (the default): each row of X is quantized to int8 per block of 32 (scale amax / 127, round
//   half to even), each block's integer dot product is exact, and the blocks are summed in order as
//   fma(float(isum - 8 * asum), sa * sw, acc);
// - int8_activations=0 (float activations): each block's dot product is the fma chain over its 32 k in order,
//   p = fma(x[k], float(q[k]), p) from 0, and the blocks are summed in order as acc = fma(p, sw, acc).
// The AVX-512, AVX2 and scalar paths compute exactly that, so they agree bit for bit.
//
// The weights are packed once, when the kernel is made, into panels of 16 columns; a call streams each panel once
// and multiplies it with every row of the call (the int4 nibbles unpacked in registers), so a call of a few rows
// costs about what one row costs where the weights' memory traffic dominates.
//
// Built by specbuild/runtime/kernels/build.py against ONNX Runtime's C API headers (docs/engine-format.md).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"

namespace specbuild_kernels {
namespace {

constexpr int64_t kBlock = 32;  // weights per scale along K
constexpr int64_t kPanel = 16;  // columns per packed panel
constexpr int kPanelBytes = kBlock * kPanel / 2;  // one block of one panel: 4 vectors of 64 bytes

// Weights packed for the kernels: panel p, block b: 4 vectors j of [16 columns][4 bytes], byte i of column c holding
// q + 8 of k = 32 b + 8 j + i in its low nibble and of k + 4 in its high one; columns past N are zero weights.
struct Packed {
  int64_t k = 0, n = 0, blocks = 0, panels = 0;
  std::vector<uint8_t> q;      // [panels][blocks][kPanelBytes]
  std::vector<float> scales;   // [panels][blocks][16]
};

Packed Pack(const uint8_t* w, const float* s, int64_t k, int64_t n) {
  Packed p;
  p.k = k;
  p.n = n;
  p.blocks = k / kBlock;
  p.panels = (n + kPanel - 1) / kPanel;
  p.q.assign(static_cast<size_t>(p.panels * p.blocks * kPanelBytes), 0x88);  // q + 8 = 8: a zero weight
  p.scales.assign(static_cast<size_t>(p.panels * p.blocks * kPanel), 0.0f);
  auto nibble = [&](int64_t row, int64_t col) -> uint8_t {
    int64_t i = row * n + col;
    uint8_t byte = w[i >> 1];
    int v = (i & 1) ? (byte >> 4) : (byte & 0x0F);  // two's complement int4
    return static_cast<uint8_t>(v ^ 8);               // its value in [-8, 7] plus 8, in [0, 15]
  };
  for (int64_t panel = 0; panel < p.panels; ++panel) {
    for (int64_t b = 0; b < p.blocks; ++b) {
      uint8_t* out = &p.q[static_cast<size_t>((panel * p.blocks + b) * kPanelBytes)];
      float* sc = &p.scales[static_cast<size_t>((panel * p.blocks + b) * kPanel)];
      for (int64_t c = 0; c < kPanel; ++c) {
        int64_t col = panel * kPanel + c;
        if (col >= n) continue;
        sc[c] = s[b * n + col];
        for (int j = 0; j < 4; ++j) {
          for (int i = 0; i < 4; ++i) {
            int64_t row = b * kBlock + 8 * j + i;
            out[j * 64 + c * 4 + i] = static_cast<uint8_t>(nibble(row, col) | (nibble(row + 4, col) << 4));
          }
        }
      }
    }
  }
  return p;
}

// A call's activations, quantized per row and block of 32: q [m][k] int8, scale [m][blocks], sum [m][blocks].
struct Rows {
  int64_t m = 0, k = 0, blocks = 0;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;
};

// One block of 32 activations: q, and (returned) its scale amax / 127 and the sum of q. Both paths give the same
// bits: max and the integer sum do not depend on the order, v * inv is one rounding either way, and the rounding to
// an integer is to nearest, ties to even (std::nearbyint in the default mode; _MM_FROUND_TO_NEAREST_INT).
float QuantizeBlockScalar(const float* v, int8_t* q, int32_t* sum_out) {
  float amax = 0.0f;
  for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
  float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    float t = std::nearbyint(v[i] * inv);
    t = std::min(127.0f, std::max(-127.0f, t));
    q[i] = static_cast<int8_t>(t);
    sum += q[i];
  }
  *sum_out = sum;
  return amax / 127.0f;
}

__attribute__((target("avx2,fma"))) float QuantizeBlockAvx2(const float* v, int8_t* q, int32_t* sum_out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(v + 8 * i);
    amax = _mm256_max_ps(_mm256_andnot_ps(sign, x[i]), amax);  // a NaN input leaves amax as the scalar path does
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float a = _mm_cvtss_f32(m4);
  float inv_s = a > 0.0f ? 127.0f / a : 0.0f;
  const __m256 inv = _mm256_set1_ps(inv_s), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) {
    __m256 t = _mm256_round_ps(_mm256_mul_ps(x[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    n[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, t)));
  }
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  *sum_out = _mm_cvtsi128_si32(s4);
  // 32 -> 16 -> 8 bits (in range: no saturation), the lanes put back in order
  __m256i w01 = _mm256_packs_epi32(n[0], n[1]), w23 = _mm256_packs_epi32(n[2], n[3]);
  __m256i b = _mm256_packs_epi16(w01, w23);
  b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b);
  return a / 127.0f;
}

struct QuantizeCall {
  Isa isa;
  const float* x;
  Rows* rows;
  int64_t per_task;  // rows per task
};

void QuantizeTask(void* data, size_t task) {
  const QuantizeCall* call = static_cast<const QuantizeCall*>(data);
  Rows& rows = *call->rows;
  int64_t r0 = static_cast<int64_t>(task) * call->per_task, r1 = std::min(rows.m, r0 + call->per_task);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < rows.blocks; ++b) {
      const float* v = call->x + r * rows.k + b * kBlock;
      int8_t* q = &rows.q[static_cast<size_t>(r * rows.k + b * kBlock)];
      size_t at = static_cast<size_t>(r * rows.blocks + b);
      rows.scale[at] = call->isa == Isa::kScalar ? QuantizeBlockScalar(v, q, &rows.sum[at])
                                                 : QuantizeBlockAvx2(v, q, &rows.sum[at]);
    }
  }
}

// A call's activations quantized, the rows shared among the threads where there are enough of them.
void Quantize(Ort::KernelContext& ctx, Isa isa, const float* x, int64_t m, int64_t k, Rows& rows) {
  rows.m = m;
  rows.k = k;
  rows.blocks = k / kBlock;
  rows.q.resize(static_cast<size_t>(m * k));
  rows.scale.resize(static_cast<size_t>(m * rows.blocks));
  rows.sum.resize(static_cast<size_t>(m * rows.blocks));
  int64_t per_task = std::max<int64_t>(1, 16384 / k);  // about 16k activations per task
  QuantizeCall call{isa, x, &rows, per_task};
  int64_t tasks = (m + per_task - 1) / per_task;
  if (tasks == 1) {
    QuantizeTask(&call, 0);
  } else {
    ctx.ParallelFor(QuantizeTask, static_cast<size_t>(tasks), 0, &call);
  }
}

// R rows' results of one panel (AVX-512: its 16 columns; AVX2: one half of 8) into y [R][ldy], the columns past N
// (cols left, which may be 0 or below for a half past it) dropped.
template <int R>
__attribute__((target("avx2,fma"))) void StoreRowsAvx2(const __m256 (&acc)[R], int64_t cols, float* y, int64_t ldy) {
  cols = std::min<int64_t>(8, cols);
  for (int r = 0; r < R && cols > 0; ++r) {
    float out[8];
    _mm256_storeu_ps(out, acc[r]);
    std::memcpy(y + r * ldy, out, static_cast<size_t>(cols) * sizeof(float));
  }
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void StoreRowsAvx512(const __m512 (&acc)[R],
                                                                                      int64_t cols, float* y,
                                                                                      int64_t ldy) {
  cols = std::min<int64_t>(kPanel, cols);
  for (int r = 0; r < R; ++r) {
    float out[kPanel];
    _mm512_storeu_ps(out, acc[r]);
    std::memcpy(y + r * ldy, out, static_cast<size_t>(cols) * sizeof(float));
  }
}

// ---- one panel (16 columns) for rows [r0, r0 + count), each path the same arithmetic

void PanelScalar(const Packed& w, const Rows& a, int64_t panel, int64_t r0, int64_t count, float* y, int64_t ldy) {
  for (int64_t r = r0; r < r0 + count; ++r) {
    float acc[kPanel] = {0};
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* q = &w.q[static_cast<size_t>((panel * w.blocks + b) * kPanelBytes)];
      const float* sw = &w.scales[static_cast<size_t>((panel * w.blocks + b) * kPanel)];
      const int8_t* qa = &a.q[static_cast<size_t>(r * a.k + b * kBlock)];
      float sa = a.scale[static_cast<size_t>(r * a.blocks + b)];
      int32_t shift = 8 * a.sum[static_cast<size_t>(r * a.blocks + b)];
      for (int64_t c = 0; c < kPanel; ++c) {
        int32_t isum = 0;
        for (int j = 0; j < 4; ++j) {
          for (int i = 0; i < 4; ++i) {
            uint8_t byte = q[j * 64 + c * 4 + i];
            isum += static_cast<int32_t>(byte & 0x0F) * qa[8 * j + i];
            isum += static_cast<int32_t>(byte >> 4) * qa[8 * j + 4 + i];
          }
        }
        acc[c] = std::fma(static_cast<float>(isum - shift), sa * sw[c], acc[c]);
      }
    }
    int64_t cols = std::min<int64_t>(kPanel, w.n - panel * kPanel);
    std::memcpy(y + r * ldy + panel * kPanel, acc, static_cast<size_t>(cols) * sizeof(float));
  }
}

template <int R>
__attribute__((target("avx2,fma"))) void PanelAvx2Rows(const Packed& w, const Rows& a, int64_t panel, int64_t r0,
                                                       float* y, int64_t ldy) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* q = &w.q[static_cast<size_t>((panel * w.blocks + b) * kPanelBytes)] + half * 32;
      __m256i wv[8];
      for (int j = 0; j < 4; ++j) {
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * 64));
        wv[2 * j] = _mm256_and_si256(v, low);
        wv[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      __m256 sw = _mm256_loadu_ps(&w.scales[static_cast<size_t>((panel * w.blocks + b) * kPanel)] + half * 8);
      for (int r = 0; r < R; ++r) {
        int64_t row = r0 + r;
        const int32_t* qa = reinterpret_cast<const int32_t*>(&a.q[static_cast<size_t>(row * a.k + b * kBlock)]);
        // pairs of products in int16 (at most 2 * 15 * 127), the 8 of a block summed there too (at most 30480: no
        // overflow), then widened once: the exact integer dot product, as on the other paths
        __m256i p16 = _mm256_maddubs_epi16(wv[0], _mm256_set1_epi32(qa[0]));
        for (int j = 1; j < 8; ++j) p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(wv[j], _mm256_set1_epi32(qa[j])));
        __m256i isum = _mm256_madd_epi16(p16, ones);
        isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * a.sum[static_cast<size_t>(row * a.blocks + b)]));
        __m256 f = _mm256_mul_ps(_mm256_set1_ps(a.scale[static_cast<size_t>(row * a.blocks + b)]), sw);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), f, acc[r]);
      }
    }
    StoreRowsAvx2<R>(acc, w.n - panel * kPanel - half * 8, y + r0 * ldy + panel * kPanel + half * 8, ldy);
  }
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void PanelAvx512Rows(const Packed& w, const Rows& a,
                                                                                      int64_t panel, int64_t r0,
                                                                                      float* y, int64_t ldy) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* q = &w.q[static_cast<size_t>((panel * w.blocks + b) * kPanelBytes)];
    __m512i wv[8];
    for (int j = 0; j < 4; ++j) {
      __m512i v = _mm512_loadu_si512(q + j * 64);
      wv[2 * j] = _mm512_and_si512(v, low);
      wv[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    __m512 sw = _mm512_loadu_ps(&w.scales[static_cast<size_t>((panel * w.blocks + b) * kPanel)]);
    for (int r = 0; r < R; ++r) {
      int64_t row = r0 + r;
      const int32_t* qa = reinterpret_cast<const int32_t*>(&a.q[static_cast<size_t>(row * a.k + b * kBlock)]);
      __m512i isum = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) isum = _mm512_dpbusd_epi32(isum, wv[j], _mm512_set1_epi32(qa[j]));
      isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(8 * a.sum[static_cast<size_t>(row * a.blocks + b)]));
      __m512 f = _mm512_mul_ps(_mm512_set1_ps(a.scale[static_cast<size_t>(row * a.blocks + b)]), sw);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), f, acc[r]);
    }
  }
  StoreRowsAvx512<R>(acc, w.n - panel * kPanel, y + r0 * ldy + panel * kPanel, ldy);
}

// ---- float activations: one panel for rows [r0, r0 + count); x [m][k] float

void PanelFloatScalar(const Packed& w, const float* x, int64_t panel, int64_t r0, int64_t count, float* y,
                      int64_t ldy) {
  for (int64_t r = r0; r < r0 + count; ++r) {
    float acc[kPanel] = {0};
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* q = &w.q[static_cast<size_t>((panel * w.blocks + b) * kPanelBytes)];
      const float* sw = &w.scales[static_cast<size_t>((panel * w.blocks + b) * kPanel)];
      const float* xb = x + r * w.k + b * kBlock;
      for (int64_t c = 0; c < kPanel; ++c) {
        float p = 0.0f;
        for (int j = 0; j < 4; ++j) {
          for (int nib = 0; nib < 2; ++nib) {
            for (int i = 0; i < 4; ++i) {  // k = 8 j + 4 nib + i: in order
              uint8_t byte = q[j * 64 + c * 4 + i];
              int u = nib ? (byte >> 4) : (byte & 0x0F);
              p = std::fma(xb[8 * j + 4 * nib + i], static_cast<float>(u) - 8.0f, p);
            }
          }
        }
        acc[c] = std::fma(p, sw[c], acc[c]);
      }
    }
    int64_t cols = std::min<int64_t>(kPanel, w.n - panel * kPanel);
    std::memcpy(y + r * ldy + panel * kPanel, acc, static_cast<size_t>(cols) * sizeof(float));
  }
}

template <int R>
__attribute__((target("avx2,fma"))) void PanelFloatAvx2Rows(const Packed& w, const float* x, int64_t panel,
                                                            int64_t r0, float* y, int64_t ldy) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  const __m256 eight = _mm256_set1_ps(8.0f);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.blocks; ++b) {
      const uint8_t* q = &w.q[static_cast<size_t>((panel * w.blocks + b) * kPanelBytes)] + half * 32;
      __m256 p[R];
      for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * 64));
        for (int nib = 0; nib < 2; ++nib) {
          for (int i = 0; i < 4; ++i) {
            __m256i u = _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(8 * i + 4 * nib)), low);
            __m256 wf = _mm256_sub_ps(_mm256_cvtepi32_ps(u), eight);  // exact: a small integer
            int64_t kk = b * kBlock + 8 * j + 4 * nib + i;
            for (int r = 0; r < R; ++r) p[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[(r0 + r) * w.k + kk]), wf, p[r]);
          }
        }
      }
      __m256 sw = _mm256_loadu_ps(&w.scales[static_cast<size_t>((panel * w.blocks + b) * kPanel)] + half * 8);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(p[r], sw, acc[r]);
    }
    StoreRowsAvx2<R>(acc, w.n - panel * kPanel - half * 8, y + r0 * ldy + panel * kPanel + half * 8, ldy);
  }
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void PanelFloatAvx512Rows(const Packed& w,
                                                                                           const float* x,
                                                                                           int64_t panel, int64_t r0,
                                                                                           float* y, int64_t ldy) {
  const __m512i low = _mm512_set1_epi32(0x0F);
  const __m512 eight = _mm512_set1_ps(8.0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* q = &w.q[static_cast<size_t>((panel * w.blocks + b) * kPanelBytes)];
    __m512 p[R];
    for (int r = 0; r < R; ++r) p[r] = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      __m512i v = _mm512_loadu_si512(q + j * 64);
      for (int nib = 0; nib < 2; ++nib) {
        for (int i = 0; i < 4; ++i) {
          __m512i u = _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(8 * i + 4 * nib)), low);
          __m512 wf = _mm512_sub_ps(_mm512_cvtepi32_ps(u), eight);
          int64_t kk = b * kBlock + 8 * j + 4 * nib + i;
          for (int r = 0; r < R; ++r) p[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[(r0 + r) * w.k + kk]), wf, p[r]);
        }
      }
    }
    __m512 sw = _mm512_loadu_ps(&w.scales[static_cast<size_t>((panel * w.blocks + b) * kPanel)]);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(p[r], sw, acc[r]);
  }
  StoreRowsAvx512<R>(acc, w.n - panel * kPanel, y + r0 * ldy + panel * kPanel, ldy);
}

// Calls of more rows: each block of the panel is unpacked once into floats (wb [32 k][16 columns]) and every row
// reads it from there, the rows' running totals in memory (acc [m][16]); the same operations in the same order as
// above, so the same bits.
constexpr int64_t kFewRows = 4;

__attribute__((target("avx2,fma"))) void UnpackAvx2(const uint8_t* q, float* wb) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  const __m256 eight = _mm256_set1_ps(8.0f);
  for (int half = 0; half < 2; ++half) {
    for (int j = 0; j < 4; ++j) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j * 64 + half * 32));
      for (int nib = 0; nib < 2; ++nib) {
        for (int i = 0; i < 4; ++i) {
          __m256i u = _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(8 * i + 4 * nib)), low);
          _mm256_store_ps(wb + (8 * j + 4 * nib + i) * kPanel + half * 8, _mm256_sub_ps(_mm256_cvtepi32_ps(u), eight));
        }
      }
    }
  }
}

template <int R>
__attribute__((target("avx2,fma"))) void BlockRowsAvx2(const float* wb, const float* sw, const float* x, int64_t k,
                                                       int64_t r0, float* acc) {
  __m256 p0[R], p1[R];
  for (int r = 0; r < R; ++r) p0[r] = p1[r] = _mm256_setzero_ps();
  for (int t = 0; t < kBlock; ++t) {
    __m256 w0 = _mm256_load_ps(wb + t * kPanel), w1 = _mm256_load_ps(wb + t * kPanel + 8);
    for (int r = 0; r < R; ++r) {
      __m256 xv = _mm256_set1_ps(x[(r0 + r) * k + t]);
      p0[r] = _mm256_fmadd_ps(xv, w0, p0[r]);
      p1[r] = _mm256_fmadd_ps(xv, w1, p1[r]);
    }
  }
  __m256 s0 = _mm256_loadu_ps(sw), s1 = _mm256_loadu_ps(sw + 8);
  for (int r = 0; r < R; ++r) {
    float* a = acc + (r0 + r) * kPanel;
    _mm256_storeu_ps(a, _mm256_fmadd_ps(p0[r], s0, _mm256_loadu_ps(a)));
    _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(p1[r], s1, _mm256_loadu_ps(a + 8)));
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void UnpackAvx512(const uint8_t* q, float* wb) {
  const __m512i low = _mm512_set1_epi32(0x0F);
  const __m512 eight = _mm512_set1_ps(8.0f);
  for (int j = 0; j < 4; ++j) {
    __m512i v = _mm512_loadu_si512(q + j * 64);
    for (int nib = 0; nib < 2; ++nib) {
      for (int i = 0; i < 4; ++i) {
        __m512i u = _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(8 * i + 4 * nib)), low);
        _mm512_store_ps(wb + (8 * j + 4 * nib + i) * kPanel, _mm512_sub_ps(_mm512_cvtepi32_ps(u), eight));
      }
    }
  }
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void BlockRowsAvx512(const float* wb, const float* sw,
                                                                                      const float* x, int64_t k,
                                                                                      int64_t r0, float* acc) {
  __m512 p[R];
  for (int r = 0; r < R; ++r) p[r] = _mm512_setzero_ps();
  for (int t = 0; t < kBlock; ++t) {
    __m512 wv = _mm512_load_ps(wb + t * kPanel);
    for (int r = 0; r < R; ++r) p[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[(r0 + r) * k + t]), wv, p[r]);
  }
  __m512 s = _mm512_loadu_ps(sw);
  for (int r = 0; r < R; ++r) {
    float* a = acc + (r0 + r) * kPanel;
    _mm512_storeu_ps(a, _mm512_fmadd_ps(p[r], s, _mm512_loadu_ps(a)));
  }
}

void PanelFloatMany(Isa isa, const Packed& w, const float* x, int64_t m, int64_t panel, float* y, int64_t ldy) {
  thread_local std::vector<float> acc_buffer;
  alignas(64) float wb[kBlock * kPanel];
  acc_buffer.assign(static_cast<size_t>(m * kPanel), 0.0f);
  float* acc = acc_buffer.data();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const uint8_t* q = &w.q[static_cast<size_t>((panel * w.blocks + b) * kPanelBytes)];
    const float* sw = &w.scales[static_cast<size_t>((panel * w.blocks + b) * kPanel)];
    const float* xb = x + b * kBlock;
    int64_t r = 0;
    if (isa == Isa::kAvx512Vnni) {
      UnpackAvx512(q, wb);
      for (; r + 8 <= m; r += 8) BlockRowsAvx512<8>(wb, sw, xb, w.k, r, acc);
      for (; r + 4 <= m; r += 4) BlockRowsAvx512<4>(wb, sw, xb, w.k, r, acc);
      for (; r < m; ++r) BlockRowsAvx512<1>(wb, sw, xb, w.k, r, acc);
    } else {
      UnpackAvx2(q, wb);
      for (; r + 6 <= m; r += 6) BlockRowsAvx2<6>(wb, sw, xb, w.k, r, acc);
      switch (m - r) {
        case 5: BlockRowsAvx2<5>(wb, sw, xb, w.k, r, acc); break;
        case 4: BlockRowsAvx2<4>(wb, sw, xb, w.k, r, acc); break;
        case 3: BlockRowsAvx2<3>(wb, sw, xb, w.k, r, acc); break;
        case 2: BlockRowsAvx2<2>(wb, sw, xb, w.k, r, acc); break;
        case 1: BlockRowsAvx2<1>(wb, sw, xb, w.k, r, acc); break;
        default: break;
      }
    }
  }
  int64_t cols = std::min<int64_t>(kPanel, w.n - panel * kPanel);
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(y + r * ldy + panel * kPanel, acc + r * kPanel, static_cast<size_t>(cols) * sizeof(float));
}

// A few rows: unpacked in registers, block sums and totals in registers; more rows: PanelFloatMany.
void PanelFloat(Isa isa, const Packed& w, const float* x, int64_t m, int64_t panel, float* y, int64_t ldy) {
  if (isa == Isa::kScalar) {
    PanelFloatScalar(w, x, panel, 0, m, y, ldy);
    return;
  }
  if (m > kFewRows) {
    PanelFloatMany(isa, w, x, m, panel, y, ldy);
    return;
  }
  if (isa == Isa::kAvx512Vnni) {
    switch (m) {
      case 4: PanelFloatAvx512Rows<4>(w, x, panel, 0, y, ldy); break;
      case 3: PanelFloatAvx512Rows<3>(w, x, panel, 0, y, ldy); break;
      case 2: PanelFloatAvx512Rows<2>(w, x, panel, 0, y, ldy); break;
      case 1: PanelFloatAvx512Rows<1>(w, x, panel, 0, y, ldy); break;
      default: break;
    }
  } else {
    switch (m) {
      case 4: PanelFloatAvx2Rows<4>(w, x, panel, 0, y, ldy); break;
      case 3: PanelFloatAvx2Rows<3>(w, x, panel, 0, y, ldy); break;
      case 2: PanelFloatAvx2Rows<2>(w, x, panel, 0, y, ldy); break;
      case 1: PanelFloatAvx2Rows<1>(w, x, panel, 0, y, ldy); break;
      default: break;
    }
  }
}

// Rows in chunks the registers hold (AVX-512: 8, AVX2: 4), then the remainder.
void Panel(Isa isa, const Packed& w, const Rows& a, int64_t panel, int64_t r, int64_t m, float* y, int64_t ldy) {
  if (isa == Isa::kAvx512Vnni) {
    for (; r + 8 <= m; r += 8) PanelAvx512Rows<8>(w, a, panel, r, y, ldy);
    switch (m - r) {
      case 7: PanelAvx512Rows<7>(w, a, panel, r, y, ldy); break;
      case 6: PanelAvx512Rows<6>(w, a, panel, r, y, ldy); break;
      case 5: PanelAvx512Rows<5>(w, a, panel, r, y, ldy); break;
      case 4: PanelAvx512Rows<4>(w, a, panel, r, y, ldy); break;
      case 3: PanelAvx512Rows<3>(w, a, panel, r, y, ldy); break;
      case 2: PanelAvx512Rows<2>(w, a, panel, r, y, ldy); break;
      case 1: PanelAvx512Rows<1>(w, a, panel, r, y, ldy); break;
      default: break;
    }
  } else if (isa == Isa::kAvx2) {
    for (; r + 4 <= m; r += 4) PanelAvx2Rows<4>(w, a, panel, r, y, ldy);
    switch (m - r) {
      case 3: PanelAvx2Rows<3>(w, a, panel, r, y, ldy); break;
      case 2: PanelAvx2Rows<2>(w, a, panel, r, y, ldy); break;
      case 1: PanelAvx2Rows<1>(w, a, panel, r, y, ldy); break;
      default: break;
    }
  } else {
    PanelScalar(w, a, panel, r, m - r, y, ldy);
  }
}

// Float activations: the rows of a call in groups whose activations (about kGroupBytes) stay in the core's cache
// while a thread sweeps the panels, one task per group and panel; a row's arithmetic does not depend on its group.
constexpr int64_t kGroupBytes = 192 * 1024;

int64_t RowGroup(int64_t k) {
  int64_t rows = kGroupBytes / (k * static_cast<int64_t>(sizeof(float)));
  return std::max<int64_t>(6, std::min<int64_t>(48, rows / 6 * 6));  // whole chunks of the AVX2 path's 6 rows
}

struct Call {
  Isa isa;
  const Packed* w;
  const Rows* a;   // int8 activations (else nullptr)
  const float* x;  // float activations: [m][k]
  int64_t m;
  float* y;
};

void PanelTask(void* data, size_t task) {
  const Call* call = static_cast<const Call*>(data);
  if (call->a != nullptr) {
    Panel(call->isa, *call->w, *call->a, static_cast<int64_t>(task), 0, call->m, call->y, call->w->n);
    return;
  }
  int64_t group = static_cast<int64_t>(task) / call->w->panels, panel = static_cast<int64_t>(task) % call->w->panels;
  int64_t size = RowGroup(call->w->k), r0 = group * size, rows = std::min(size, call->m - r0);
  PanelFloat(call->isa, *call->w, call->x + r0 * call->w->k, rows, panel, call->y + r0 * call->w->n, call->w->n);
}

// ---- the operator

struct BlockInt4MatMulKernel {
  explicit BlockInt4MatMulKernel(const OrtKernelInfo* info) {
    Ort::ConstKernelInfo kernel_info(info);
    int64_t block = kernel_info.GetAttribute<int64_t>("block_size");
    if (block != kBlock) throw std::runtime_error("BlockInt4MatMul: block_size must be 32");
    try {
      int8_activations_ = kernel_info.GetAttribute<int64_t>("int8_activations") != 0;
    } catch (const Ort::Exception&) {
      int8_activations_ = true;  // the attribute's default
    }
    int w_constant = 0, s_constant = 0;
    Ort::ConstValue w = kernel_info.GetTensorConstantInput(1, &w_constant);
    Ort::ConstValue s = kernel_info.GetTensorConstantInput(2, &s_constant);
    if (!w_constant || !s_constant) throw std::runtime_error("BlockInt4MatMul: weights and scales must be constants");
    auto w_info = w.GetTensorTypeAndShapeInfo();
    std::vector<int64_t> shape = w_info.GetShape();
    if (w_info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT4 || shape.size() != 2 || shape[0] % kBlock)
      throw std::runtime_error("BlockInt4MatMul: weights must be int4 [K, N] with K a multiple of 32");
    std::vector<int64_t> s_shape = s.GetTensorTypeAndShapeInfo().GetShape();
    if (s_shape.size() != 2 || s_shape[0] != shape[0] / kBlock || s_shape[1] != shape[1])
      throw std::runtime_error("BlockInt4MatMul: scales must be [K / 32, N]");
    packed_ = Pack(static_cast<const uint8_t*>(w.GetTensorRawData()), static_cast<const float*>(s.GetTensorRawData()),
                   shape[0], shape[1]);
    isa_ = ChosenIsa();
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Ort::ConstValue x = ctx.GetInput(0);
    std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || shape.back() != packed_.k)
      throw std::runtime_error("BlockInt4MatMul: X's last dimension != K");
    int64_t m = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) m *= shape[i];
    shape.back() = packed_.n;
    Ort::UnownedValue out = ctx.GetOutput(0, shape);
    float* y = out.GetTensorMutableData<float>();
    if (m == 0) return;
    Rows rows;
    if (int8_activations_) Quantize(ctx, isa_, x.GetTensorData<float>(), m, packed_.k, rows);
    Call call{isa_, &packed_, int8_activations_ ? &rows : nullptr, x.GetTensorData<float>(), m, y};
    int64_t groups = int8_activations_ ? 1 : (m + RowGroup(packed_.k) - 1) / RowGroup(packed_.k);
    ctx.ParallelFor(PanelTask, static_cast<size_t>(packed_.panels * groups), 0, &call);
  }

 private:
  Packed packed_;
  Isa isa_ = Isa::kScalar;
  bool int8_activations_ = true;
};

struct BlockInt4MatMulOp : Ort::CustomOpBase<BlockInt4MatMulOp, BlockInt4MatMulKernel> {
  void* CreateKernel(const OrtApi& /*api*/, const OrtKernelInfo* info) const {
    return new BlockInt4MatMulKernel(info);
  }
  const char* GetName() const { return "BlockInt4MatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT4 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t /*index*/) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

void AddBlockInt4MatMul(Ort::CustomOpDomain& domain) {
  static BlockInt4MatMulOp op;
  domain.Add(&op);
}

}  // namespace specbuild_kernels
