// Small numeric helpers shared by the CPU kernels of worker/kernels/ (build.py hashes this header with them).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace coalesce {

// exp for x <= 0 (softmax after subtracting the max, sigmoid of -|x|), written so that loops over it
// vectorize: libm's expf does not. 2**n * p(r) with r = x - n ln2, |r| <= ln2 / 2, p a degree-6 Taylor
// polynomial (relative error under 2e-7); below -87 the result is 0.
#pragma omp declare simd
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// bfloat16 (the top half of a float32) -> float32.
inline float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof bits);
  return x;
}

// float32 -> bfloat16, rounded to nearest even (as torch's conversion; no NaNs come here).
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// IEEE half -> float32, for machines without F16C (normal, subnormal, zero; no infinities or NaNs come here).
inline float from_f16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float x;
  if (exp == 0) {
    x = std::ldexp(static_cast<float>(man), -24);
  } else {
    const uint32_t bits = ((exp + 112) << 23) | (man << 13);
    std::memcpy(&x, &bits, sizeof bits);
  }
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits |= sign;
  std::memcpy(&x, &bits, sizeof bits);
  return x;
}

}  // namespace coalesce
