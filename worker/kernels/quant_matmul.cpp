// Weight-only quantized matmuls for a few rows of activations, on the CPU. Built and called by
// worker/kernels/quant_matmul.py, which says why they exist and what the weight formats are.
//
// The activations are quantized to int8 per group of 32 (a float scale each, and the group's sum for the int4
// format's minimums), as llama.cpp does, so that 32 products of a group are one integer instruction:
// AVX512-VNNI's vpdpbusd (u8 x s8, summed in fours into int32), or AVX2's maddubs + madd. Each weight group is
// unpacked once per tile of up to kRows activation rows. Parallel over output channels with OpenMP (torch's pool:
// see paged_attention.cpp). Plain C ABI over raw pointers, as paged_attention.cpp.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define QM_AVX2 1
#endif

#include "numeric.h"

namespace {

using coalesce::exp_nonpositive;
using coalesce::from_bf16;
using coalesce::to_bf16;

constexpr int64_t kGroup = 32;   // weights and activations are scaled per group of 32 input channels
constexpr int64_t kRows = 4;   // activation rows computed together against one unpacked weight row

struct Args {
  int64_t m, n, k;     // out [m, n] = f(x) [m, k] @ W^T, W [n, k]
  int64_t bits;        // 4 or 8 (see quant_matmul.py for the layouts)
  int64_t x_bf16;      // x is bfloat16 (else float32)
  int64_t out_bf16;    // out is bfloat16 (else float32)
  int64_t prologue;    // 0: f(x) = x; 1: RMSNorm, x * rsqrt(mean(x^2) + eps) * norm; 2: x [m, 2k], silu(x[:, :k]) * x[:, k:]
  int64_t accumulate;  // out += result (a residual) instead of out = result
  float eps;
};

inline float f16(uint16_t h) {
#ifdef QM_AVX2
  return _cvtsh_ss(h);
#else
  return coalesce::from_f16(h);
#endif
}

// The activations, quantized. For int4 weights the groups go in pairs laid out as the unpacked weights come:
// [g: 0..15][g+1: 0..15][g: 16..31][g+1: 16..31] (64 bytes; a missing g+1 is zeros); for int8 in order.
struct Acts {
  int64_t groups, row;       // groups per activation row; bytes per quantized row
  std::vector<int8_t> q;     // [m, row]
  std::vector<float> scale;  // [m, groups rounded up to even]: x ~ q * scale
  std::vector<float> sum;    // [m, groups rounded up to even]: the group's sum of q * scale (int4's minimums)
};

inline float silu(float g) {
  const float e = exp_nonpositive(-std::abs(g));  // sigmoid from exp(-|g|): no overflow either side
  return g * (g >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e));
}

// Row i of f(x) into y [k] as floats.
void prologue_row(const Args& a, const void* x, const float* norm, int64_t i, float* y) {
  const int64_t k = a.k, width = a.prologue == 2 ? 2 * k : k;
  std::vector<float> tmp;
  const float* src;
  if (a.x_bf16) {
    tmp.resize(width);
    const uint16_t* row = static_cast<const uint16_t*>(x) + i * width;
    for (int64_t c = 0; c < width; ++c) tmp[c] = from_bf16(row[c]);
    src = tmp.data();
  } else {
    src = static_cast<const float*>(x) + i * width;
  }
  if (a.prologue == 1) {
    float ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < k; ++c) ss += src[c] * src[c];
    const float r = 1.0f / std::sqrt(ss / k + a.eps);
    for (int64_t c = 0; c < k; ++c) y[c] = src[c] * r * norm[c];
  } else if (a.prologue == 2) {
#pragma omp simd
    for (int64_t c = 0; c < k; ++c) y[c] = silu(src[c]) * src[k + c];
  } else {
    std::memcpy(y, src, k * sizeof(float));
  }
}

// Quantize row i of f(x) (symmetric, per group, round half to even).
void quantize_row(const Args& a, const void* x, const float* norm, int64_t i, Acts& acts) {
  std::vector<float> y(a.k);
  prologue_row(a, x, norm, i, y.data());
  const int64_t padded = (acts.groups + 1) / 2 * 2;
  int8_t* q = acts.q.data() + i * acts.row;
  float* scale = acts.scale.data() + i * padded;
  float* sum = acts.sum.data() + i * padded;
  for (int64_t g = 0; g < acts.groups; ++g) {
    const float* v = y.data() + g * kGroup;
    float amax = 0;
    for (int64_t c = 0; c < kGroup; ++c) amax = std::max(amax, std::abs(v[c]));
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    int32_t codes = 0;
    for (int64_t c = 0; c < kGroup; ++c) {
      const int32_t code = static_cast<int32_t>(std::nearbyint(v[c] * inv));
      codes += code;
      // where element c of group g lands (see Acts)
      const int64_t at = a.bits == 8 ? g * kGroup + c : (g / 2) * 64 + (c / 16) * 32 + (g % 2) * 16 + c % 16;
      q[at] = static_cast<int8_t>(code);
    }
    scale[g] = amax / 127.0f;
    // The sum of the quantized values, not of x: then an int4 row's result is exactly W . (q * scale), as
    // int8's is. (Summing x instead adds min * (what rounding lost), noise 3x larger than that loss's own.)
    sum[g] = scale[g] * codes;
  }
}

#ifdef QM_AVX2
// acc + the 4-wide sums of u8 x s8 products, per int32 lane.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// res[j] = sum over groups of W row . row (i0 + j) of the activations, j < R; int4 weights.
template <int R>
void row_q4(const uint8_t* w, const uint16_t* d, const uint16_t* mins, const Acts& x, int64_t i0, float* res) {
  const int64_t groups = x.groups, padded = (groups + 1) / 2 * 2;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  __m256 acc[R];
  for (int j = 0; j < R; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g += 2) {
    const bool pair = g + 1 < groups;
    const __m256i v = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 16))
                           : _mm256_inserti128_si256(_mm256_setzero_si256(),
                                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * 16)), 0);
    const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    // [d_g x4, d_g+1 x4]
    const uint32_t dd = pair ? static_cast<uint32_t>(d[g]) | static_cast<uint32_t>(d[g + 1]) << 16 : d[g];
    const __m256 dv = _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dd)))), spread);
    for (int j = 0; j < R; ++j) {
      const int8_t* q = x.q.data() + (i0 + j) * x.row + g * 32;
      __m256i p = dot_u8s8(_mm256_setzero_si256(), lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
      p = dot_u8s8(p, hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32)));
      const float* s = x.scale.data() + (i0 + j) * padded + g;
      const __m256 sv = _mm256_set_m128(_mm_set1_ps(s[1]), _mm_set1_ps(s[0]));
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dv, sv), acc[j]);
    }
  }
  for (int j = 0; j < R; ++j) {  // + sum over groups of min_g * sum(x_g)
    const float* s = x.sum.data() + (i0 + j) * padded;
    __m256 m = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
      m = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g))),
                          _mm256_loadu_ps(s + g), m);
    float tail = 0;
    for (; g < groups; ++g) tail += f16(mins[g]) * s[g];
    res[j] = hsum(_mm256_add_ps(acc[j], m)) + tail;
  }
}

// The same for int8 weights (per group: 32 int8 and one half-precision scale).
template <int R>
void row_q8(const int8_t* w, const uint16_t* d, const Acts& x, int64_t i0, float* res) {
  const int64_t groups = x.groups, padded = (groups + 1) / 2 * 2;
  __m256 acc[R];
  for (int j = 0; j < R; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * kGroup));
    const __m256i u = _mm256_sign_epi8(v, v);  // |w| as u8; the sign moves onto the activations
    const float dg = f16(d[g]);
    for (int j = 0; j < R; ++j) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + (i0 + j) * x.row + g * kGroup));
      const __m256i p = dot_u8s8(_mm256_setzero_si256(), u, _mm256_sign_epi8(q, v));
      const float s = dg * x.scale[(i0 + j) * padded + g];
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s), acc[j]);
    }
  }
  for (int j = 0; j < R; ++j) res[j] = hsum(acc[j]);
}
#else
// Portable versions of the above (no AVX2): the same arithmetic, one product at a time.
template <int R>
void row_q4(const uint8_t* w, const uint16_t* d, const uint16_t* mins, const Acts& x, int64_t i0, float* res) {
  const int64_t groups = x.groups, padded = (groups + 1) / 2 * 2;
  for (int j = 0; j < R; ++j) {
    const int8_t* q = x.q.data() + (i0 + j) * x.row;
    const float* s = x.scale.data() + (i0 + j) * padded;
    const float* sum = x.sum.data() + (i0 + j) * padded;
    float total = 0;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t dot = 0;
      for (int64_t c = 0; c < kGroup; ++c) {
        const int32_t code = c < 16 ? w[g * 16 + c] & 0x0F : w[g * 16 + c - 16] >> 4;
        dot += code * q[(g / 2) * 64 + (c / 16) * 32 + (g % 2) * 16 + c % 16];
      }
      total += f16(d[g]) * s[g] * dot + f16(mins[g]) * sum[g];
    }
    res[j] = total;
  }
}

template <int R>
void row_q8(const int8_t* w, const uint16_t* d, const Acts& x, int64_t i0, float* res) {
  const int64_t groups = x.groups, padded = (groups + 1) / 2 * 2;
  for (int j = 0; j < R; ++j) {
    const int8_t* q = x.q.data() + (i0 + j) * x.row;
    float total = 0;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t dot = 0;
      for (int64_t c = 0; c < kGroup; ++c) dot += w[g * kGroup + c] * q[g * kGroup + c];
      total += f16(d[g]) * x.scale[(i0 + j) * padded + g] * dot;
    }
    res[j] = total;
  }
}
#endif

template <int R>
void row(const Args& a, const uint8_t* codes, const uint16_t* d, const uint16_t* mins, const Acts& x, int64_t n,
         int64_t i0, float* res) {
  const int64_t groups = a.k / kGroup;
  if (a.bits == 4) {
    row_q4<R>(codes + n * a.k / 2, d + n * groups, mins + n * groups, x, i0, res);
  } else {
    row_q8<R>(reinterpret_cast<const int8_t*>(codes) + n * a.k, d + n * groups, x, i0, res);
  }
}

// A weight as quant_matmul.py packs it, and its bias (float32, or null).
struct Weight {
  const uint8_t* codes;
  const uint16_t *d, *mins;
  const float* bias;
};

// out [m, n] (=, or += with accumulate) f(x) @ W^T + bias; norm [k] float32 for RMSNorm (else unused).
void qmatmul(const Args& a, const void* x, const float* norm, const Weight& w, void* out) {
  Acts acts;
  acts.groups = a.k / kGroup;
  const int64_t padded = (acts.groups + 1) / 2 * 2;
  acts.row = a.bits == 4 ? padded / 2 * 64 : a.k;
  acts.q.assign(a.m * acts.row, 0);
  acts.scale.assign(a.m * padded, 0.0f);
  acts.sum.assign(a.m * padded, 0.0f);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < a.m; ++i) quantize_row(a, x, norm, i, acts);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < a.n; ++n) {
      for (int64_t i0 = 0; i0 < a.m; i0 += kRows) {
        float res[kRows];
        switch (std::min(kRows, a.m - i0)) {
          case 1: row<1>(a, w.codes, w.d, w.mins, acts, n, i0, res); break;
          case 2: row<2>(a, w.codes, w.d, w.mins, acts, n, i0, res); break;
          case 3: row<3>(a, w.codes, w.d, w.mins, acts, n, i0, res); break;
          default: row<4>(a, w.codes, w.d, w.mins, acts, n, i0, res); break;
        }
        for (int64_t j = 0; j < std::min(kRows, a.m - i0); ++j) {
          const int64_t at = (i0 + j) * a.n + n;
          const float v = res[j] + (w.bias ? w.bias[n] : 0.0f);
          if (a.out_bf16) {
            uint16_t* o = static_cast<uint16_t*>(out) + at;
            *o = to_bf16(a.accumulate ? from_bf16(*o) + v : v);
          } else {
            float* o = static_cast<float*>(out) + at;
            *o = a.accumulate ? *o + v : v;
          }
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// out [m, n] (=, or += with accumulate) f(x) @ W^T + bias. codes, d (and mins for 4 bits) hold W as
// quant_matmul.py lays it out; norm [k] float32 (RMSNorm only); bias [n] float32 or null.
void quant_matmul(const Args* args, const void* x, const float* norm, const uint8_t* codes, const uint16_t* d,
                  const uint16_t* mins, const float* bias, void* out) {
  qmatmul(*args, x, norm, Weight{codes, d, mins, bias}, out);
}

}  // extern "C"
