// float64 vectors one register wide for the float64 kernels (few_query_attention_cpu.cpp, moe_f64_cpu.cpp,
// linear_f64_cpu.cpp):
// GCC/Clang vector types, so one source builds for AVX-512 (8 lanes), AVX2 (4) or neither (the compiler
// splits the vectors), with the build's flags (kernels/cpu_ext.py).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace composer::f64 {

#ifdef __AVX512F__
constexpr int64_t VW = 8;  // float64 lanes of a vector register
#else
constexpr int64_t VW = 4;
#endif
typedef double vd __attribute__((vector_size(VW * 8)));

inline __attribute__((always_inline)) vd loadv(const double* x) { vd r; std::memcpy(&r, x, sizeof r); return r; }
inline __attribute__((always_inline)) void storev(double* x, vd r) { std::memcpy(x, &r, sizeof r); }

inline double hsum(vd v) {  // the lanes in order, from 0.0
  double s = 0.0;
  for (int64_t j = 0; j < VW; ++j) s += v[j];
  return s;
}

// VW weights widened to float64 (exactly: every float32 and bfloat16 value is a float64 value)
typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
inline __attribute__((always_inline)) vd widen(const double* w) { return loadv(w); }
inline __attribute__((always_inline)) vd widen(const float* w) {
#ifdef __AVX512F__  // one conversion: GCC 12 splits the generic one below into four instructions
  return (vd)_mm512_cvtps_pd(_mm256_loadu_ps(w));
#else
  vf f;
  std::memcpy(&f, w, sizeof f);
  return __builtin_convertvector(f, vd);
#endif
}
inline __attribute__((always_inline)) vd widen(const at::BFloat16* w) {  // a bfloat16 is a float32's high half
#ifdef __AVX512F__  // likewise
  const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), 16);
  return (vd)_mm512_cvtps_pd(_mm256_castsi256_ps(u));
#else
  vh b;
  std::memcpy(&b, w, sizeof b);
  const vu u = __builtin_convertvector(b, vu) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return __builtin_convertvector(f, vd);
#endif
}

// cols[j] = lane j of every rows[o] (lane o): a VW x VW transpose in registers
inline __attribute__((always_inline)) void transpose(const vd* rows, vd* cols) {
#ifdef __AVX512F__
  const __m512d t0 = _mm512_unpacklo_pd(rows[0], rows[1]), t1 = _mm512_unpackhi_pd(rows[0], rows[1]);
  const __m512d t2 = _mm512_unpacklo_pd(rows[2], rows[3]), t3 = _mm512_unpackhi_pd(rows[2], rows[3]);
  const __m512d t4 = _mm512_unpacklo_pd(rows[4], rows[5]), t5 = _mm512_unpackhi_pd(rows[4], rows[5]);
  const __m512d t6 = _mm512_unpacklo_pd(rows[6], rows[7]), t7 = _mm512_unpackhi_pd(rows[6], rows[7]);
  const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  const __m512d u0 = _mm512_permutex2var_pd(t0, lo, t2), u2 = _mm512_permutex2var_pd(t0, hi, t2);
  const __m512d u1 = _mm512_permutex2var_pd(t1, lo, t3), u3 = _mm512_permutex2var_pd(t1, hi, t3);
  const __m512d u4 = _mm512_permutex2var_pd(t4, lo, t6), u6 = _mm512_permutex2var_pd(t4, hi, t6);
  const __m512d u5 = _mm512_permutex2var_pd(t5, lo, t7), u7 = _mm512_permutex2var_pd(t5, hi, t7);
  const __m512i first = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11), last = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
  cols[0] = (vd)_mm512_permutex2var_pd(u0, first, u4);
  cols[1] = (vd)_mm512_permutex2var_pd(u1, first, u5);
  cols[2] = (vd)_mm512_permutex2var_pd(u2, first, u6);
  cols[3] = (vd)_mm512_permutex2var_pd(u3, first, u7);
  cols[4] = (vd)_mm512_permutex2var_pd(u0, last, u4);
  cols[5] = (vd)_mm512_permutex2var_pd(u1, last, u5);
  cols[6] = (vd)_mm512_permutex2var_pd(u2, last, u6);
  cols[7] = (vd)_mm512_permutex2var_pd(u3, last, u7);
#else
  for (int64_t j = 0; j < VW; ++j)
    for (int64_t o = 0; o < VW; ++o) cols[j][o] = rows[o][j];
#endif
}

// hsum of VW vectors at once: lane o of the result is v[o]'s lanes summed one by one in lane order, from
// 0.0, the additions hsum makes (so the same value), VW sums side by side (a transpose, then VW vector adds)
inline vd hsums(const vd* v) {
  vd cols[VW];
  transpose(v, cols);
  vd s{};
  for (int64_t j = 0; j < VW; ++j) s += cols[j];
  return s;
}

// the dot products of VW consecutive weight rows (each n values, contiguous) with one input row x (n
// values): each row's products summed in two chains (even and odd vectors), then the chains added and
// their lanes summed (hsums): 2 VW independent chains, where one row at a time left the FMA units waiting
// on one chain's latency (the kernel ran at ~1/10 of their rate)
template <typename W>
inline vd dots(const W* w, const double* x, int64_t n) {
  vd a[VW][2];
  for (int64_t o = 0; o < VW; ++o) a[o][0] = a[o][1] = vd{};
  for (int64_t c = 0; c < n; c += 2 * VW) {
    const bool odd = c + VW < n;
    const vd x0 = loadv(x + c), x1 = odd ? loadv(x + c + VW) : vd{};
    for (int64_t o = 0; o < VW; ++o) {
      a[o][0] += widen(w + o * n + c) * x0;
      if (odd) a[o][1] += widen(w + o * n + c + VW) * x1;
    }
  }
  vd s[VW];
  for (int64_t o = 0; o < VW; ++o) s[o] = a[o][0] + a[o][1];
  return hsums(s);
}

}  // namespace composer::f64
