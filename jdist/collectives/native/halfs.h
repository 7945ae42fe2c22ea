// Sums of float16/bfloat16 buffers accumulated in float32, rounded once to
// nearest even (as XLA and numpy convert): jdist's 16-bit wire format.
#ifndef JDIST_COLLECTIVES_NATIVE_HALFS_H_
#define JDIST_COLLECTIVES_NATIVE_HALFS_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace jdist {

inline float Bf16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float F16ToF32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t u;
  if (exponent == 0x1f) {
    u = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent == 0) {
    float f = static_cast<float>(mantissa) * (1.0f / 16777216.0f);  // subnormal: m * 2^-24
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else {
    u = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t F32ToF16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0));
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to infinity
  if (x < 0x38800000u) {  // below float16's smallest normal: a multiple of 2^-24
    float a;
    std::memcpy(&a, &x, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  x += 0xfffu + ((x >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((x - 0x38000000u) >> 13));
}

#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) inline void Sum16F16C(const void* const* ins, int n_ins,
                                                          void* out_raw, int64_t count) {
  uint16_t* out = static_cast<uint16_t*>(out_raw);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    __m256 acc = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(ins[0]) + i)));
    for (int k = 1; k < n_ins; ++k) {
      acc = _mm256_add_ps(acc, _mm256_cvtph_ps(_mm_loadu_si128(
                                   reinterpret_cast<const __m128i*>(
                                       static_cast<const uint16_t*>(ins[k]) + i))));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(acc, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < count; ++i) {
    float acc = F16ToF32(static_cast<const uint16_t*>(ins[0])[i]);
    for (int k = 1; k < n_ins; ++k) acc += F16ToF32(static_cast<const uint16_t*>(ins[k])[i]);
    out[i] = F32ToF16(acc);
  }
}
#endif

// out = round16(sum_k float32(ins[k])), elementwise; `out` may alias ins[0].
inline void Sum16(bool bf16, const void* const* ins, int n_ins, void* out_raw, int64_t count) {
#if defined(__x86_64__)
  static const bool has_f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  if (!bf16 && has_f16c) return Sum16F16C(ins, n_ins, out_raw, count);
#endif
  uint16_t* out = static_cast<uint16_t*>(out_raw);
  constexpr int64_t kBlock = 1024;
  float acc[kBlock];
  for (int64_t start = 0; start < count; start += kBlock) {
    int64_t n = count - start < kBlock ? count - start : kBlock;
    for (int k = 0; k < n_ins; ++k) {
      const uint16_t* in = static_cast<const uint16_t*>(ins[k]) + start;
      if (bf16) {
        if (k == 0) {
          for (int64_t i = 0; i < n; ++i) acc[i] = Bf16ToF32(in[i]);
        } else {
          for (int64_t i = 0; i < n; ++i) acc[i] += Bf16ToF32(in[i]);
        }
      } else {
        if (k == 0) {
          for (int64_t i = 0; i < n; ++i) acc[i] = F16ToF32(in[i]);
        } else {
          for (int64_t i = 0; i < n; ++i) acc[i] += F16ToF32(in[i]);
        }
      }
    }
    for (int64_t i = 0; i < n; ++i) out[start + i] = bf16 ? F32ToBf16(acc[i]) : F32ToF16(acc[i]);
  }
}

}  // namespace jdist

#endif  // JDIST_COLLECTIVES_NATIVE_HALFS_H_
