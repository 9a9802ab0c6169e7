// A MoE layer's routed experts on a CPU, router output in, layer output out, in one call:
// out[t] = sum_k weights[t, k] * w2[e] (silu(gate_e x[t]) * up_e x[t]) with e = ids[t, k].
//
// x [T, D], ids [T, K] int64, weights [T, K] float32, w13t [E, D, 2I] and w2t [E, I, D] contiguous
// (input-major: the transposes of the checkpoint's [E, 2I, D] gate_up and [E, D, I] down). Returns
// out [T, D] in x's dtype.
//
// Why: a decode step gives each expert a handful of rows, so each expert's matmuls are bound by
// streaming its weights from memory. A library sgemm at 2-16 rows streams well below memory bandwidth
// and costs a dispatch per call (two per expert), and sorting pairs, gathering rows, weighting and
// summing took a dozen more torch ops (and allocations) per layer. Here (token, expert) pairs are
// counted and sorted by expert; an expert with few rows streams its weights once, keeping blocks of its
// output rows in vector registers (bfloat16 weights are widened to float32 in registers: half the bytes
// of float32 ones); an expert with many rows (prefill) goes to a library GEMM, which is compute-bound
// there: oneDNN's for float32 (see `gemm`), torch's own otherwise. Experts are split over the intra-op
// threads, so two cores stream two experts at once. Each token's expert outputs are then summed in
// ascending expert order (as the torch grouped path does), so the result does not depend on the thread
// count. Accumulation is in float32.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/silu.h>
#include <c10/core/InferenceMode.h>

#include <immintrin.h>

#include "onednn_linear.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

namespace composer {
namespace {

constexpr int64_t kStreamRows = 64;  // the most rows per expert any streaming loop takes; more: gemm

// How many rows an expert may have and still go through the streaming loop rather than gemm, for
// float32 / bfloat16 weights on a vector CPU, measured (16 experts, D 768, I 384, 2 cores, AVX-512): the
// register-blocked float32 loop beats MKL's sgemm up to 64 rows (5.6 vs 9.0 ms), and oneDNN's float32 GEMM
// does not beat it there either (16-64 rows: 5-15% faster with 16 experts of [768, 384], 3-50% slower
// with 32 of [512, 256]: its per-call cost shows on small matrices), while oneDNN's bf16 GEMM,
// with the CPU's bf16 dot products, overtakes the bf16 loop past ~20 rows; elsewhere the plain loop, 16.
template <typename scalar_t>
constexpr int64_t stream_limit() {
#if defined(__AVX512F__) || defined(__AVX2__)
  if constexpr (std::is_same_v<scalar_t, float>) return kStreamRows;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) return 16;
#endif
  return 16;
}

// rows [M, K] @ b_KN [K, N] for an expert with many rows. float32 goes to oneDNN's GEMM (the op torch's
// CPU linear fusion uses, found through the dispatcher since torch does not export oneDNN itself): torch's
// float32 mm is MKL's sgemm, which on AMD CPUs runs its AVX2 code even where AVX-512 is there. Measured
// one thread, [1024, 768] @ [768, 768]: 108 GFLOP/s sgemm, 251 oneDNN (2 cores, AMD Zen 5). Other
// dtypes, or a torch without the op: at::mm (bfloat16 mm already runs on oneDNN).
inline at::Tensor gemm(const at::Tensor& rows, const at::Tensor& b_KN) {
  if (rows.scalar_type() != at::kFloat || !onednn_linear()) return at::mm(rows, b_KN);
  return onednn_linear_call(rows, b_KN.t(), std::nullopt);
}

// out[m, :] = sum_k a[m, k] * b[k, :] for m < n (n <= stream_limit), b [K, N] row-major. Four weight
// rows at a time per output row: one load and store of the output per four FMAs (the loop is bound by
// L1 stores otherwise), while the four rows stay in L1 for the next output row.
template <typename scalar_t>
inline void stream_rows(const float* a, int64_t n, int64_t K, const scalar_t* b, int64_t N, float* out) {
  std::fill(out, out + n * N, 0.f);
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const scalar_t *b0 = b + k * N, *b1 = b0 + N, *b2 = b1 + N, *b3 = b2 + N;
    for (int64_t m = 0; m < n; ++m) {
      const float* am = a + m * K + k;
      const float a0 = am[0], a1 = am[1], a2 = am[2], a3 = am[3];
      float* om = out + m * N;
#pragma omp simd
      for (int64_t j = 0; j < N; ++j)
        om[j] += a0 * static_cast<float>(b0[j]) + a1 * static_cast<float>(b1[j]) +
                 a2 * static_cast<float>(b2[j]) + a3 * static_cast<float>(b3[j]);
    }
  }
  for (; k < K; ++k) {
    const scalar_t* bk = b + k * N;
    for (int64_t m = 0; m < n; ++m) {
      const float am = a[m * K + k];
      float* om = out + m * N;
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) om[j] += am * static_cast<float>(bk[j]);
    }
  }
}

#if defined(__AVX512F__) || defined(__AVX2__)
// The vector path, for float32 and bfloat16 weights alike: out rows kept in registers over all of K.
// For R output rows and V vectors of columns, each step of k loads V weight vectors once (a bf16 one
// widened to float32: the top half of a float32, so a zero-extend and a shift) and does R x V FMAs into
// accumulators, with no loads or stores of the output until the end. The loop above, which updates the
// outputs in L1 every four k, is bound by those loads and stores at ~8 rows, and by widening each bf16
// weight once per output row (bf16 experts were no faster than float32 ones, at half the bytes).
#ifdef __AVX512F__
using vec = __m512;
constexpr int64_t kWidth = 16;
constexpr int kPassRows = 14;  // 14 x 2 accumulators + 2 weights + 1 broadcast <= 32 registers
inline vec load_w(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline vec load_w(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec splat(float x) { return _mm512_set1_ps(x); }
inline vec zero() { return _mm512_setzero_ps(); }
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
#else
using vec = __m256;
constexpr int64_t kWidth = 8;
constexpr int kPassRows = 6;  // 6 x 2 accumulators + 2 weights + 1 broadcast <= 16 registers
inline vec load_w(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline vec load_w(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec splat(float x) { return _mm256_set1_ps(x); }
inline vec zero() { return _mm256_setzero_ps(); }
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
#endif

// out[r, j0 : j0 + V * kWidth] = sum_k a[r, k] * b[k, j0 : ...] for r < R
// A tile walks its weights down the rows, a few vectors per row, one row per step: a strided stream the
// hardware prefetcher follows poorly. Each step asks for the same columns ~128 KiB of rows ahead (whole
// rows), which measured best over 64-384 KiB on both bench shapes (e16 batch 32, 4 layers: float32
// 8.1 -> 6.1 ms, bfloat16 7.6 -> 3.5 ms).
constexpr int64_t kAheadBytes = 128 * 1024;

template <int R, int V, typename scalar_t>
inline void tile(const float* a, int64_t K, const scalar_t* b, int64_t N, float* out, int64_t j0) {
  vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = zero();
  const scalar_t* bk = b + j0;
  const int64_t ahead = kAheadBytes / (N * int64_t(sizeof(scalar_t))) * N * int64_t(sizeof(scalar_t));
  for (int64_t k = 0; k < K; ++k, bk += N) {
    vec w[V];
    for (int v = 0; v < V; ++v) {
      _mm_prefetch(reinterpret_cast<const char*>(bk + v * kWidth) + ahead, _MM_HINT_T0);
      w[v] = load_w(bk + v * kWidth);
    }
    for (int r = 0; r < R; ++r) {
      const vec ar = splat(a[r * K + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = fma(ar, w[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store(out + r * N + j0 + v * kWidth, acc[r][v]);
}

// The widest tile that fits the registers for R rows: V vectors of columns, R x V accumulators, V weights
// and a broadcast. Fewer columns per tile for more rows, so that a whole expert's rows (decode: ~2-20)
// take one pass over its weights, each weight vector widened once and used R times.
template <int R>
constexpr int tile_vectors() {
#ifdef __AVX512F__
  return R <= 2 ? 8 : R <= 4 ? 5 : R <= 6 ? 4 : R <= 8 ? 3 : 2;
#else
  return R <= 1 ? 6 : R <= 2 ? 4 : R <= 4 ? 3 : 2;
#endif
}

template <int R, typename scalar_t>
inline void rows_pass(const float* a, int64_t K, const scalar_t* b, int64_t N, float* out) {
  constexpr int V = tile_vectors<R>();
  int64_t j = 0;
  for (; j + V * kWidth <= N; j += V * kWidth) tile<R, V>(a, K, b, N, out, j);
  for (; j + kWidth <= N; j += kWidth) tile<R, 1>(a, K, b, N, out, j);
}

template <int R, typename scalar_t>
inline void rows_pass_dispatch(int64_t rows, const float* a, int64_t K, const scalar_t* b, int64_t N, float* out) {
  if constexpr (R <= kPassRows) {
    if (rows == R) return rows_pass<R>(a, K, b, N, out);
    return rows_pass_dispatch<R + 1>(rows, a, K, b, N, out);
  }
}

template <typename scalar_t>
inline bool stream_rows_vec(const float* a, int64_t n, int64_t K, const scalar_t* b, int64_t N, float* out) {
  if (N % kWidth != 0) return false;  // not a whole number of vectors: the plain loop
  const int64_t passes = (n + kPassRows - 1) / kPassRows;  // past kPassRows rows, balanced passes
  for (int64_t p = 0, m = 0; p < passes; ++p) {
    const int64_t rows = (n - m) / (passes - p);
    rows_pass_dispatch<1>(rows, a + m * K, K, b, N, out + m * N);
    m += rows;
  }
  return true;
}
#endif

template <typename scalar_t>
inline void stream(const float* a, int64_t n, int64_t K, const scalar_t* b, int64_t N, float* out) {
#if defined(__AVX512F__) || defined(__AVX2__)
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    if (stream_rows_vec(a, n, K, b, N, out)) return;
  }
#endif
  stream_rows(a, n, K, b, N, out);
}

template <typename scalar_t>
void experts(const at::Tensor& x, const int64_t* ids, const float* weights, int64_t K, const at::Tensor& w13t,
             const at::Tensor& w2t, at::Tensor& out) {
  const int64_t T = x.size(0), P = T * K;
  const int64_t E = w13t.size(0), D = w13t.size(1), I2 = w13t.size(2), I = I2 / 2;
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* w13p = w13t.data_ptr<scalar_t>();
  const scalar_t* w2p = w2t.data_ptr<scalar_t>();
  // pairs sorted by expert (a counting sort; within an expert by token), and where each pair went
  std::vector<int64_t> offsets(E + 1, 0), pair_at(P), sorted(P);
  for (int64_t p = 0; p < P; ++p) ++offsets[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
  for (int64_t p = 0; p < P; ++p) {
    pair_at[p] = fill[ids[p]]++;
    sorted[pair_at[p]] = p;
  }
  // each pair's expert output, times its router weight: scratch kept per calling thread (the engine's),
  // since a fresh buffer of this size is a fresh mmap, page faults and zeroing on every layer and step
  // (a pointer, not the thread_local itself, goes into the parallel regions: each thread has its own)
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < P * D) scratch.resize(P * D);
  float* const y = scratch.data();
  // Experts are handed out one at a time, the most rows first, to whichever thread is free: a static
  // split gives a thread whose experts got more rows, or that the OS paused for the server's event loop,
  // the whole step to wait for (each expert's result does not depend on the thread that ran it).
  std::vector<int64_t> order;
  for (int64_t e = 0; e < E; ++e)
    if (offsets[e + 1] > offsets[e]) order.push_back(e);  // never read an expert no token chose
  std::stable_sort(order.begin(), order.end(), [&](int64_t l, int64_t r) {
    return offsets[l + 1] - offsets[l] > offsets[r + 1] - offsets[r];
  });
  std::atomic<int64_t> next{0};
  const int64_t hit = static_cast<int64_t>(order.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), hit), 1, [&](int64_t, int64_t) {
    c10::InferenceMode guard;  // thread-local: a worker thread's GEMM must not build autograd state
    // per-thread buffers for the streamed experts' rows, kept between calls: sized for up to 64 rows they
    // would be a fresh mmap, zeroed, for every layer and step
    thread_local std::vector<float> a, gu, h;
    const int64_t most = stream_limit<scalar_t>();
    if (static_cast<int64_t>(a.size()) < most * D) a.resize(most * D);
    if (static_cast<int64_t>(gu.size()) < most * I2) gu.resize(most * I2);
    if (static_cast<int64_t>(h.size()) < most * I) h.resize(most * I);
    for (int64_t i = next++; i < hit; i = next++) {
      const int64_t e = order[i], s = offsets[e], n = offsets[e + 1] - s;
      float* ye = y + s * D;
      if (n > stream_limit<scalar_t>()) {  // many rows: a library GEMM is compute-bound and better at it
        auto rows = at::empty({n, D}, x.options());
        scalar_t* rp = rows.data_ptr<scalar_t>();
        for (int64_t m = 0; m < n; ++m) std::copy_n(xp + (sorted[s + m] / K) * D, D, rp + m * D);
        auto g = gemm(rows, w13t[e]);
        auto act = at::silu(g.narrow(1, 0, I)).mul_(g.narrow(1, I, I));
        auto down = gemm(act, w2t[e]).to(at::kFloat).contiguous();
        const float* dp = down.data_ptr<float>();
        for (int64_t m = 0; m < n; ++m) {
          const float wm = weights[sorted[s + m]];
          for (int64_t j = 0; j < D; ++j) ye[m * D + j] = wm * dp[m * D + j];
        }
        continue;
      }
      for (int64_t m = 0; m < n; ++m) {
        const scalar_t* xr = xp + (sorted[s + m] / K) * D;
        for (int64_t j = 0; j < D; ++j) a[m * D + j] = static_cast<float>(xr[j]);
      }
      stream(a.data(), n, D, w13p + e * D * I2, I2, gu.data());
      for (int64_t m = 0; m < n; ++m) {
        const float* g = gu.data() + m * I2;
        for (int64_t i = 0; i < I; ++i) h[m * I + i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
      }
      stream(h.data(), n, I, w2p + e * I * D, D, ye);
      for (int64_t m = 0; m < n; ++m) {
        const float wm = weights[sorted[s + m]];
        for (int64_t j = 0; j < D; ++j) ye[m * D + j] *= wm;
      }
    }
  });
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    std::vector<int64_t> order(K);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k = 0; k < K; ++k) order[k] = t * K + k;
      std::sort(order.begin(), order.end(), [&](int64_t l, int64_t r) { return ids[l] < ids[r]; });
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p : order) {
        const float* yp = y + pair_at[p] * D;
        for (int64_t j = 0; j < D; ++j) acc[j] += yp[j];
      }
      for (int64_t j = 0; j < D; ++j) op[t * D + j] = static_cast<scalar_t>(acc[j]);
    }
  });
}

}  // namespace

std::string moe_float32_gemm() { return onednn_linear() ? "onednn" : "mm"; }

at::Tensor moe_experts(at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor w13t, at::Tensor w2t) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, D]");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "ids must be contiguous int64 [T, K]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "weights must be contiguous float32 [T, K], like ids");
  TORCH_CHECK(w13t.dim() == 3 && w13t.is_contiguous() && w2t.dim() == 3 && w2t.is_contiguous(),
              "w13t [E, D, 2I] and w2t [E, I, D] must be contiguous");
  const int64_t E = w13t.size(0), D = w13t.size(1), I2 = w13t.size(2);
  TORCH_CHECK(x.size(1) == D && I2 % 2 == 0 && w2t.size(0) == E && w2t.size(1) == I2 / 2 && w2t.size(2) == D,
              "shapes differ: x [T, D], w13t [E, D, 2I], w2t [E, I, D]");
  TORCH_CHECK(x.scalar_type() == w13t.scalar_type() && w2t.scalar_type() == w13t.scalar_type(),
              "x and the weights must share a dtype");
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < ids.numel(); ++p)
    TORCH_CHECK(ip[p] >= 0 && ip[p] < E, "expert id ", ip[p], " is outside 0..", E - 1);
  auto out = at::empty({x.size(0), D}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "moe_experts", [&] {
    experts<scalar_t>(x, ip, weights.data_ptr<float>(), ids.size(1), w13t, w2t, out);
  });
  return out;
}

}  // namespace composer
