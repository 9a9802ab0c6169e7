// float64 vectors one register wide for the float64 kernels (few_query_attention_cpu.cpp, moe_f64_cpu.cpp):
// GCC/Clang vector types, so one source builds for AVX-512 (8 lanes), AVX2 (4) or neither (the compiler
// splits the vectors), with the build's flags (kernels/cpu_ext.py).
#pragma once

#include <cstdint>
#include <cstring>

namespace composer::f64 {

#ifdef __AVX512F__
constexpr int64_t VW = 8;  // float64 lanes of a vector register
#else
constexpr int64_t VW = 4;
#endif
typedef double vd __attribute__((vector_size(VW * 8)));

inline __attribute__((always_inline)) vd loadv(const double* x) { vd r; std::memcpy(&r, x, sizeof r); return r; }
inline __attribute__((always_inline)) void storev(double* x, vd r) { std::memcpy(x, &r, sizeof r); }

}  // namespace composer::f64
