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
  void *k_cache, *v_cache;  // [blocks, block_size, kv_heads, head_dim], bfloat16 or float32
};

struct Model {
  int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, bits, cache_bf16;
  float eps;
  const Layer* layer;
};

// One step of m sequences, one new token each. cos and sin: [m, head_dim] float32 RoPE rows of the tokens'
// positions (sin sign-folded, as worker/model.py's rope_tables); slots [m]: where each token's K/V goes;
// tables [m, max_blocks] and lengths [m] (this token included): what each sequence attends over.
struct Step {
  int64_t m, max_blocks, window;
  const float *cos, *sin;
  const int64_t *slots, *tables, *lengths;
};

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

template <typename T>
void layers(const Model& md, const Step& st, float* x) {
  const int64_t m = st.m, dim = md.head_dim, q_size = md.heads * dim, kv_size = md.kv_heads * dim;
  const int64_t qkv_size = q_size + 2 * kv_size;
  std::vector<float> qkv(m * qkv_size), q(m * q_size), attn(m * q_size), gate_up(m * 2 * md.intermediate);
  Args a{m, 0, md.hidden, md.bits, 0, 0, 0, 0, md.eps};
  const Shape sh{m, md.heads, md.kv_heads, dim, 1, md.block_size, st.max_blocks, st.window,
                 1.0f / std::sqrt(static_cast<float>(dim))};
  for (int64_t l = 0; l < md.layers; ++l) {
    const Layer& ly = md.layer[l];
    a.n = qkv_size, a.k = md.hidden, a.prologue = 1, a.accumulate = 0;
    qmatmul(a, x, ly.attn_norm, ly.qkv, qkv.data());
    for (int64_t i = 0; i < m; ++i) {
      float* row = qkv.data() + i * qkv_size;
      rope(row, md.heads + md.kv_heads, dim, st.cos + i * dim, st.sin + i * dim);
      std::memcpy(q.data() + i * q_size, row, q_size * sizeof(float));
      const int64_t at = st.slots[i] * kv_size;
      store(static_cast<T*>(ly.k_cache) + at, row + q_size, kv_size);
      store(static_cast<T*>(ly.v_cache) + at, row + q_size + kv_size, kv_size);
    }
    decode_any(q.data(), static_cast<const T*>(ly.k_cache), nullptr, static_cast<const T*>(ly.v_cache), nullptr,
               nullptr, st.tables, st.lengths, sh, Tail{}, attn.data());
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
  if (model->cache_bf16) {
    layers<uint16_t>(*model, *step, x);
  } else {
    layers<float>(*model, *step, x);
  }
}

}  // extern "C"
