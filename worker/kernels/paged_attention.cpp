// Decode attention read straight from the paged KV cache, and int8 writes into it, for the CPU worker.
// Built and called by worker/kernels/paged_attention.py, which says why they exist and what they compute.
//
// Plain C ABI over raw pointers (no torch headers: the file compiles in about a second). Parallel over
// (sequence, KV head) with OpenMP; the process's libgomp is torch's own (same SONAME), so this shares
// torch's thread pool instead of competing with it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "numeric.h"

namespace {

using coalesce::exp_nonpositive;
using coalesce::to_bf16;

// One cached row (a position's K or V of one KV head) as floats. Int8 rows are scaled per channel group;
// `scales` maps a one-byte code to its float scale (worker/kv_quant.py).
template <int64_t G>
inline void load_groups(const int8_t* src, const uint8_t* codes, const float* scales, int64_t dim, int64_t group,
                        float* dst) {
  const int64_t n = G ? G : group;  // G: the group size as a compile-time constant (loops fully vectorized)
  for (int64_t g = 0; g * n < dim; ++g) {
    const float s = scales[codes[g]];
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) dst[g * n + c] = s * src[g * n + c];
  }
}

inline void load_row(const int8_t* src, const uint8_t* codes, const float* scales, int64_t dim, int64_t group,
                     float* dst) {
  if (group == 32) return load_groups<32>(src, codes, scales, dim, group, dst);  // kv_quant.GROUP
  load_groups<0>(src, codes, scales, dim, group, dst);
}

inline void load_row(const uint16_t* src, const uint8_t*, const float*, int64_t dim, int64_t, float* dst) {
#pragma omp simd
  for (int64_t c = 0; c < dim; ++c) {  // bfloat16: the top half of a float32
    const uint32_t bits = static_cast<uint32_t>(src[c]) << 16;
    std::memcpy(&dst[c], &bits, sizeof bits);
  }
}

inline void load_row(const float* src, const uint8_t*, const float*, int64_t dim, int64_t, float* dst) {
  std::memcpy(dst, src, dim * sizeof(float));
}

// dst += a bfloat16 row (a tail's residual).
inline void add_row(const uint16_t* src, int64_t dim, float* dst) {
#pragma omp simd
  for (int64_t c = 0; c < dim; ++c) {
    const uint32_t bits = static_cast<uint32_t>(src[c]) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof bits);
    dst[c] += x;
  }
}

struct Shape {
  int64_t seqs, heads, kv_heads, dim, groups, block_size, max_blocks, window;
  float softmax_scale;
};

// An int8 cache's full-precision tails (worker/kv_cache.py): bfloat16 rows holding what int8 lost of each
// sequence's newest positions. Positions p >= lo[s] of sequence s are read from its blocks plus row
// rows[s * block_size + p % block_size] of the tail. Null pointers: no tails.
struct Tail {
  const uint16_t *k, *v;
  const int64_t *lo, *rows;
};

// Calls f(p, r) for positions p in [lo, end) of a sequence, r being the cache row of p's KV head h: block by
// block along its table (no division per position). Blocks lie anywhere in memory, which defeats the
// hardware prefetcher at each block boundary, so the next block's rows of `data` are prefetched.
template <typename T, typename F>
inline void for_rows(const int64_t* table, int64_t lo, int64_t end, const Shape& sh, int64_t h, const T* data,
                     int64_t dim, F f) {
  const int64_t bs = sh.block_size, last = (end - 1) / bs;
  for (int64_t b = lo / bs, p = lo; p < end; ++b) {
    if (b < last)
      for (int64_t o = 0; o < bs; ++o) {
        const char* row = reinterpret_cast<const char*>(data + ((table[b + 1] * bs + o) * sh.kv_heads + h) * dim);
        for (int64_t byte = 0; byte < dim * int64_t(sizeof(T)); byte += 64) __builtin_prefetch(row + byte);
      }
    const int64_t first = table[b] * bs - b * bs;  // the row of position p is first + p
    for (const int64_t stop = std::min(end, (b + 1) * bs); p < stop; ++p) f(p, (first + p) * sh.kv_heads + h);
  }
}

// out[s, h] = softmax(q[s, h] . K[s]^T * scale) V[s] over positions [lo, length[s]) of sequence s, whose
// position p lives in block tables[s, p / block_size] at offset p % block_size. The query heads that share
// a KV head are done together, so each cached row is read once.
template <typename T, int D>
void decode(const float* q, const T* k, const uint8_t* k_codes, const T* v, const uint8_t* v_codes,
            const float* scales, const int64_t* tables, const int64_t* lengths, const Shape& sh, const Tail& tail,
            float* out) {
  // D: the head_dim as a compile-time constant (loops unrolled, the queries kept in registers), 0 for any.
  const int64_t per_kv = sh.heads / sh.kv_heads, dim = D ? D : sh.dim, group = dim / sh.groups;
  const int64_t jobs = sh.seqs * sh.kv_heads;
#pragma omp parallel
  {
    std::vector<float> row(dim), acc(per_kv * dim), total(per_kv), weights;  // per thread, reused by its jobs
#pragma omp for schedule(dynamic, 1)
    for (int64_t job = 0; job < jobs; ++job) {
      const int64_t s = job / sh.kv_heads, h = job % sh.kv_heads, length = lengths[s];
      const int64_t lo = sh.window > 0 ? std::max<int64_t>(0, length - sh.window) : 0, n = length - lo;
      const float* qs = q + (s * sh.heads + h * per_kv) * dim;
      const int64_t* table = tables + s * sh.max_blocks;
      weights.resize(per_kv * n);
      // Positions [split, length) add the sequence's tail rows to what its blocks hold.
      const int64_t split = tail.lo ? std::clamp(tail.lo[s], lo, length) : length;
      const int64_t* tail_rows = tail.rows ? tail.rows + s * sh.block_size : nullptr;
      // f(p) for p in [split, length) with `row` holding what the blocks hold plus the tail's residual.
      auto tail_pass = [&](const T* data, const uint8_t* codes, const uint16_t* residuals, auto f) {
        for (int64_t p = split; p < length; ++p) {
          const int64_t o = p % sh.block_size, r = (table[p / sh.block_size] * sh.block_size + o) * sh.kv_heads + h;
          load_row(data + r * dim, codes + r * sh.groups, scales, dim, group, row.data());
          add_row(residuals + (tail_rows[o] * sh.kv_heads + h) * dim, dim, row.data());
          f(p);
        }
      };
      auto score = [&](int64_t p) {
        for (int64_t j = 0; j < per_kv; ++j) {
          float dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t c = 0; c < dim; ++c) dot += qs[j * dim + c] * row[c];
          weights[j * n + p - lo] = dot * sh.softmax_scale;
        }
      };
      for_rows(table, lo, split, sh, h, k, dim, [&](int64_t p, int64_t r) {
        load_row(k + r * dim, k_codes + r * sh.groups, scales, dim, group, row.data());
        score(p);
      });
      tail_pass(k, k_codes, tail.k, score);
      for (int64_t j = 0; j < per_kv; ++j) {
        float* w = weights.data() + j * n;
        const float m = *std::max_element(w, w + n);
        float sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          w[i] = exp_nonpositive(w[i] - m);
          sum += w[i];
        }
        total[j] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      auto accumulate = [&](int64_t p) {
        for (int64_t j = 0; j < per_kv; ++j) {
          const float w = weights[j * n + p - lo];
          float* a = acc.data() + j * dim;
#pragma omp simd
          for (int64_t c = 0; c < dim; ++c) a[c] += w * row[c];
        }
      };
      for_rows(table, lo, split, sh, h, v, dim, [&](int64_t p, int64_t r) {
        load_row(v + r * dim, v_codes + r * sh.groups, scales, dim, group, row.data());
        accumulate(p);
      });
      tail_pass(v, v_codes, tail.v, accumulate);
      for (int64_t j = 0; j < per_kv; ++j) {
        float* o = out + (s * sh.heads + h * per_kv + j) * dim;
        const float inv = 1.0f / total[j];
#pragma omp simd
        for (int64_t c = 0; c < dim; ++c) o[c] = acc[j * dim + c] * inv;
      }
    }
  }
}

template <typename T>
void decode_any(const float* q, const T* k, const uint8_t* k_codes, const T* v, const uint8_t* v_codes,
                const float* scales, const int64_t* tables, const int64_t* lengths, const Shape& sh, const Tail& tail,
                float* out) {
  switch (sh.dim) {
    case 32: return decode<T, 32>(q, k, k_codes, v, v_codes, scales, tables, lengths, sh, tail, out);
    case 64: return decode<T, 64>(q, k, k_codes, v, v_codes, scales, tables, lengths, sh, tail, out);
    case 128: return decode<T, 128>(q, k, k_codes, v, v_codes, scales, tables, lengths, sh, tail, out);
    default: return decode<T, 0>(q, k, k_codes, v, v_codes, scales, tables, lengths, sh, tail, out);
  }
}

}  // namespace

extern "C" {

// The three cache dtypes. k_codes/v_codes, scales and tail are ignored (may be null) but for int8; a null
// tail (or tail->lo) means no tails.
void decode_int8(const float* q, const int8_t* k, const uint8_t* k_codes, const int8_t* v, const uint8_t* v_codes,
                 const float* scales, const int64_t* tables, const int64_t* lengths, const Shape* sh,
                 const Tail* tail, float* out) {
  decode_any(q, k, k_codes, v, v_codes, scales, tables, lengths, *sh, tail ? *tail : Tail{}, out);
}

void decode_bf16(const float* q, const uint16_t* k, const uint8_t*, const uint16_t* v, const uint8_t*, const float*,
                 const int64_t* tables, const int64_t* lengths, const Shape* sh, const Tail*, float* out) {
  decode_any(q, k, nullptr, v, nullptr, nullptr, tables, lengths, *sh, Tail{}, out);
}

void decode_f32(const float* q, const float* k, const uint8_t*, const float* v, const uint8_t*, const float*,
                const int64_t* tables, const int64_t* lengths, const Shape* sh, const Tail*, float* out) {
  decode_any(q, k, nullptr, v, nullptr, nullptr, tables, lengths, *sh, Tail{}, out);
}

// x: [rows, kv_heads, dim] float32 (already rotated) quantized into cache rows slots[i] as worker/kv_quant.py's
// quantize() does: per channel group, code = ceil((log2 max|x| - offset) * steps) clamped to [0, 255],
// q = round-half-even(x / scales[code]) clamped to +-qmax. Where tail_rows[i] >= 0 (tail_rows may be null), what
// that lost, x - q * scale, also goes to bfloat16 row tail_rows[i] of `tail` ([tail rows, kv_heads, dim]).
void quantize_write(const float* x, const int64_t* slots, int64_t rows, int64_t kv_heads, int64_t dim,
                    int64_t groups, const float* scales, float offset, float steps, float qmax, int8_t* data,
                    uint8_t* codes, const int64_t* tail_rows, uint16_t* tail) {
  const int64_t group = dim / groups, vectors = rows * kv_heads;
#pragma omp parallel for if (vectors > 256)
  for (int64_t i = 0; i < vectors; ++i) {
    const int64_t dst = slots[i / kv_heads] * kv_heads + i % kv_heads;
    const int64_t tail_row = tail_rows ? tail_rows[i / kv_heads] : -1;
    uint16_t* residual = tail_row >= 0 ? tail + (tail_row * kv_heads + i % kv_heads) * dim : nullptr;
    for (int64_t g = 0; g < groups; ++g) {
      const float* src = x + i * dim + g * group;
      float amax = 0;
      for (int64_t c = 0; c < group; ++c) amax = std::max(amax, std::fabs(src[c]));
      const float code = std::ceil((std::log2(amax) - offset) * steps);  // -inf for an all-zero group: code 0
      const int c8 = static_cast<int>(std::clamp(code, 0.0f, 255.0f));
      const float s = scales[c8];
      codes[dst * groups + g] = static_cast<uint8_t>(c8);
      int8_t* d = data + dst * dim + g * group;
      for (int64_t c = 0; c < group; ++c)
        d[c] = static_cast<int8_t>(std::clamp(std::nearbyint(src[c] / s), -qmax, qmax));
      if (residual)
        for (int64_t c = 0; c < group; ++c) residual[g * group + c] = to_bf16(src[c] - d[c] * s);
    }
  }
}

}  // extern "C"
