// Every decoder layer of a decode step in one call, for quantized weights on the CPU. Called by
// worker/quant_decode.py (through decode_step.py), which says when it is used and why.
//
// One translation unit with the two kernels it strings together (their files are included, not linked: each
// also builds alone as its own library).

#include "paged_attention.cpp"
#include "quant_matmul.cpp"

namespace {

// One decoder layer: its quantized linears, its norms' weights (float32) and its KV cache stores.
struct Layer {
  Weight qkv, o, gate_up, down;
  const float *attn_norm, *mlp_norm;
  void *k_cache, *v_cache;  // [blocks, block_size, kv_heads, head_dim], bfloat16, float32 or int8
  uint8_t *k_codes, *v_codes;  // int8: scale codes [blocks, block_size, kv_heads, groups]
  uint16_t *k_tail, *v_tail;   // int8: bfloat16 tail rows [rows, kv_heads, head_dim] (worker/kv_cache.py), or null
};

// An int8 cache (worker/kv_quant.py): vectors stored rotated by `rotation` [head_dim, head_dim], one scale code
// per group of head_dim / groups channels; `scales` maps a code to its scale; offset, steps, qmax as
// paged_attention.cpp's quantize_write takes them.
struct Int8Cache {
  int64_t groups;
  const float *rotation, *scales;
  float offset, steps, qmax;
};

struct Model {
  int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, bits, cache_bf16, cache_int8;
  float eps;
  const Layer* layer;
  Int8Cache int8;
};

// One step of m sequences, one new token each. cos and sin: [m, head_dim] float32 RoPE rows of the tokens'
// positions (sin sign-folded, as worker/model.py's rope_tables); slots [m]: where each token's K/V goes;
// tables [m, max_blocks] and lengths [m] (this token included): what each sequence attends over.
struct Step {
  int64_t m, max_blocks, window;
  const float *cos, *sin;
  const int64_t *slots, *tables, *lengths;
  // Int8 caches with tails: each token's tail row (-1: none), and per sequence the first position its tail
  // corrects and its tail row per block offset (paged_attention.cpp's Tail). Null: no tails.
  const int64_t *tail_rows, *tail_lo, *tail_index;
};

// x [n, dim] <- x R (transposed: x R^T), R [dim, dim] row-major.
void rotate_rows(float* x, int64_t n, int64_t dim, const float* r, bool transposed) {
  std::vector<float> y(dim);
  for (int64_t i = 0; i < n; ++i) {
    float* v = x + i * dim;
    std::fill(y.begin(), y.end(), 0.0f);
    for (int64_t a = 0; a < dim; ++a)
      for (int64_t b = 0; b < dim; ++b) y[b] += v[a] * (transposed ? r[b * dim + a] : r[a * dim + b]);
    std::copy(y.begin(), y.end(), v);
  }
}

// x [heads, dim] rotated in place: x * cos + roll(x, dim / 2) * sin (worker/model.py's rotate).
void rope(float* x, int64_t heads, int64_t dim, const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * dim;
    for (int64_t c = 0; c < half; ++c) {
      const float a = v[c], b = v[c + half];
      v[c] = a * cos[c] + b * sin[c];
      v[c + half] = b * cos[c + half] + a * sin[c + half];
    }
  }
}

template <typename T>
void store(T* dst, const float* src, int64_t n);

template <>
void store(float* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

template <>
void store(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t c = 0; c < n; ++c) dst[c] = to_bf16(src[c]);
}

// The attention of one layer: this step's K/V (rotated q, k, v in qkv rows) into the cache, then q over it.
template <typename T>
void attend(const Model& md, const Step& st, const Layer& ly, const Shape& sh, float* qkv, float* q, float* attn) {
  const int64_t m = st.m, dim = md.head_dim, q_size = md.heads * dim, kv_size = md.kv_heads * dim;
  const int64_t qkv_size = q_size + 2 * kv_size;
  for (int64_t i = 0; i < m; ++i) {
    const float* row = qkv + i * qkv_size;
    std::memcpy(q + i * q_size, row, q_size * sizeof(float));
    const int64_t at = st.slots[i] * kv_size;
    store(static_cast<T*>(ly.k_cache) + at, row + q_size, kv_size);
    store(static_cast<T*>(ly.v_cache) + at, row + q_size + kv_size, kv_size);
  }
  decode_any(q, static_cast<const T*>(ly.k_cache), nullptr, static_cast<const T*>(ly.v_cache), nullptr, nullptr,
             st.tables, st.lengths, sh, Tail{}, attn);
}

// The same over an int8 cache: K, V and q rotated by R (the cache holds K and V so), K and V quantized into
// their rows (and what that lost into their tail rows), the output rotated back (worker/attention.py).
template <>
void attend<int8_t>(const Model& md, const Step& st, const Layer& ly, const Shape& sh, float* qkv, float* q,
                    float* attn) {
  const Int8Cache& c = md.int8;
  const int64_t m = st.m, dim = md.head_dim, q_size = md.heads * dim, kv_size = md.kv_heads * dim;
  const int64_t qkv_size = q_size + 2 * kv_size;
  std::vector<float> k(m * kv_size), v(m * kv_size);
  for (int64_t i = 0; i < m; ++i) {
    const float* row = qkv + i * qkv_size;
    std::memcpy(q + i * q_size, row, q_size * sizeof(float));
    std::memcpy(k.data() + i * kv_size, row + q_size, kv_size * sizeof(float));
    std::memcpy(v.data() + i * kv_size, row + q_size + kv_size, kv_size * sizeof(float));
  }
  rotate_rows(q, m * md.heads, dim, c.rotation, false);
  rotate_rows(k.data(), m * md.kv_heads, dim, c.rotation, false);
  rotate_rows(v.data(), m * md.kv_heads, dim, c.rotation, false);
  const bool tails = ly.k_tail && ly.v_tail;  // a cache keeps tails (and this step has some: st's pointers)
  const int64_t* rows = tails ? st.tail_rows : nullptr;
  quantize_write(k.data(), st.slots, m, md.kv_heads, dim, c.groups, c.scales, c.offset, c.steps, c.qmax,
                 static_cast<int8_t*>(ly.k_cache), ly.k_codes, rows, rows ? ly.k_tail : nullptr);
  quantize_write(v.data(), st.slots, m, md.kv_heads, dim, c.groups, c.scales, c.offset, c.steps, c.qmax,
                 static_cast<int8_t*>(ly.v_cache), ly.v_codes, rows, rows ? ly.v_tail : nullptr);
  const Tail tail = tails && st.tail_lo ? Tail{ly.k_tail, ly.v_tail, st.tail_lo, st.tail_index} : Tail{};
  decode_any(q, static_cast<const int8_t*>(ly.k_cache), ly.k_codes, static_cast<const int8_t*>(ly.v_cache),
             ly.v_codes, c.scales, st.tables, st.lengths, sh, tail, attn);
  rotate_rows(attn, m * md.heads, dim, c.rotation, true);
}

template <typename T>
void layers(const Model& md, const Step& st, float* x) {
  const int64_t m = st.m, dim = md.head_dim, q_size = md.heads * dim, kv_size = md.kv_heads * dim;
  const int64_t qkv_size = q_size + 2 * kv_size;
  std::vector<float> qkv(m * qkv_size), q(m * q_size), attn(m * q_size), gate_up(m * 2 * md.intermediate);
  Args a{m, 0, md.hidden, md.bits, 0, 0, 0, 0, md.eps};
  const int64_t groups = md.cache_int8 ? md.int8.groups : 1;
  const Shape sh{m, md.heads, md.kv_heads, dim, groups, md.block_size, st.max_blocks, st.window,
                 1.0f / std::sqrt(static_cast<float>(dim))};
  for (int64_t l = 0; l < md.layers; ++l) {
    const Layer& ly = md.layer[l];
    a.n = qkv_size, a.k = md.hidden, a.prologue = 1, a.accumulate = 0;
    qmatmul(a, x, ly.attn_norm, ly.qkv, qkv.data());
    for (int64_t i = 0; i < m; ++i)
      rope(qkv.data() + i * qkv_size, md.heads + md.kv_heads, dim, st.cos + i * dim, st.sin + i * dim);
    attend<T>(md, st, ly, sh, qkv.data(), q.data(), attn.data());
    a.n = md.hidden, a.k = q_size, a.prologue = 0, a.accumulate = 1;
    qmatmul(a, attn.data(), nullptr, ly.o, x);
    a.n = 2 * md.intermediate, a.k = md.hidden, a.prologue = 1, a.accumulate = 0;
    qmatmul(a, x, ly.mlp_norm, ly.gate_up, gate_up.data());
    a.n = md.hidden, a.k = md.intermediate, a.prologue = 2, a.accumulate = 1;
    qmatmul(a, gate_up.data(), nullptr, ly.down, x);
  }
}

}  // namespace

extern "C" {

// x [m, hidden] float32: the embeddings in, the last layer's output out (before the final norm).
void decode_step(const Model* model, const Step* step, float* x) {
  if (model->cache_int8) {
    layers<int8_t>(*model, *step, x);
  } else if (model->cache_bf16) {
    layers<uint16_t>(*model, *step, x);
  } else {
    layers<float>(*model, *step, x);
  }
}

}  // extern "C"
