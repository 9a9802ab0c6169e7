// A MoE layer's routed experts on a CPU, router output in, layer output out, in one call:
// out[t] = sum_k weights[t, k] * w2[e] (silu(gate_e x[t]) * up_e x[t]) with e = ids[t, k].
//
// x [T, D], ids [T, K] int64, weights [T, K] float32, w13b [E, ceil(2I / 32), D, 32] and w2b
// [E, ceil(D / 32), I, 32] contiguous: the checkpoint's [E, 2I, D] gate_up and [E, D, I] down, blocked
// (see kBlock; kernels/moe.py's block_experts makes them). Returns out [T, D] in x's dtype.
//
// Why: a decode step gives each expert a handful of rows, so each expert's matmuls are bound by
// streaming its weights from memory. A library sgemm at 2-16 rows streams well below memory bandwidth
// and costs a dispatch per call (two per expert), and sorting pairs, gathering rows, weighting and
// summing took a dozen more torch ops (and allocations) per layer. Here (token, expert) pairs are
// counted and sorted by expert; an expert with few rows streams its weights once, block by block, keeping
// its output rows in vector registers (bfloat16 weights are widened to float32 in registers: half the bytes
// of float32 ones), and the same loop, register-blocked over groups of rows, takes a float32 prefill's
// ~100-250 rows an expert too (see stream_limit); an expert with more rows (bfloat16: past 16) goes to a
// library GEMM, which is compute-bound there: oneDNN's for float32 (see `gemm`), torch's own otherwise. Experts are split over the intra-op
// threads, so two cores stream two experts at once. Each token's expert outputs are then summed in
// ascending expert order (as the torch grouped path does), so the result does not depend on the thread
// count. Accumulation is in float32.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
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

constexpr int64_t kStreamRows = 256;  // the most rows per expert any streaming loop takes; more: gemm
constexpr int64_t kDecodeRows = 64;  // past this many rows the loop's SwiGLU is at::silu's (vectorised), as gemm's

// How many rows an expert may have and still go through the streaming loop rather than gemm, for
// float32 / bfloat16 weights on a vector CPU, measured (16 experts, D 768, I 384, 2 cores, AVX-512): the
// register-blocked float32 loop beats MKL's sgemm up to 64 rows (5.6 vs 9.0 ms), and oneDNN's float32 GEMM
// does not beat it there either (16-64 rows: 5-15% faster with 16 experts of [768, 384], 3-50% slower
// with 32 of [512, 256]: its per-call cost shows on small matrices), while oneDNN's bf16 GEMM,
// with the CPU's bf16 dot products, overtakes the bf16 loop past ~20 rows; elsewhere the plain loop, 16.
// float32 up to 256 rows since issue 53: a prefill of 8 x 128 tokens gives e32's experts ~128 rows each, and
// there the loop (weights streamed once, each pair of blocks re-read from L2 by every group of rows) beats
// unblocking each expert's weights and handing them to oneDNN, which reorders them again: the experts of
// that prefill took 0.32 s instead of 0.41-0.45 s (one thread, AMD EPYC, a loaded 2-core VM).
template <typename scalar_t>
constexpr int64_t stream_limit() {
#if defined(__AVX512F__) || defined(__AVX2__)
  if constexpr (std::is_same_v<scalar_t, float>) return kStreamRows;
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) return 16;
#endif
  return 16;
}

// rows [M, K] @ b_KN [K, N] (plain) for an expert with many rows. float32 goes to oneDNN's GEMM (the op torch's
// CPU linear fusion uses, found through the dispatcher since torch does not export oneDNN itself): torch's
// float32 mm is MKL's sgemm, which on AMD CPUs runs its AVX2 code even where AVX-512 is there. Measured
// one thread, [1024, 768] @ [768, 768]: 108 GFLOP/s sgemm, 251 oneDNN (2 cores, AMD Zen 5). Other
// dtypes, or a torch without the op: at::mm (bfloat16 mm already runs on oneDNN).
inline at::Tensor gemm(const at::Tensor& rows, const at::Tensor& b_KN) {
  if (rows.scalar_type() != at::kFloat || !onednn_linear()) return at::mm(rows, b_KN);
  return onednn_linear_call(rows, b_KN.t(), std::nullopt);
}

// Expert weights come blocked (kernels/moe.py's block_experts): a [K, N] input-major matrix is cut into
// column blocks of kBlock, each stored as its own contiguous [K, kBlock] (the last block zero-padded past
// N). A pass over a block then reads one contiguous stream. In the plain [K, N] layout each register tile
// read a few vectors from every row, a strided walk the hardware prefetcher follows poorly, even with
// software prefetches. Measured, all layers of a step, 2 threads, AMD Zen 5, float32, batch 8 / 32:
// e16 (16 experts of [768, 768] + [384, 768]) 1.21x / 1.15x faster, e32 (32 of [512, 512] + [256, 512])
// 1.36x / 1.27x. The width does not depend on the CPU, so a packed model is the same everywhere.
//
// In a bfloat16 block row, columns c and c + 16 share a 32-bit word (c in the low half): one load then
// gives two float32 vectors, one by a shift and one by a mask, where widening 16 bf16 at a time takes a
// load, a zero-extend and a shift per vector (e32 bf16 experts at batch 32: 1.05-1.11x -> 1.17-1.19x the
// old layout's speed; e16 even either way).
constexpr int64_t kBlock = 32;

template <typename scalar_t>
constexpr bool kPaired = std::is_same_v<scalar_t, c10::BFloat16>;

// where column c of a block (c < kBlock) lies in its row
template <typename scalar_t>
constexpr int64_t position(int64_t c) {
  if constexpr (kPaired<scalar_t>) return c < kBlock / 2 ? 2 * c : 2 * (c - kBlock / 2) + 1;
  return c;
}

// out[m, :N] = sum_k a[m, k] * b[k, :N] for m < n, b blocked: the plain loop (no vector unit, or float16).
template <typename scalar_t>
inline void stream_scalar(const float* a, int64_t n, int64_t K, const scalar_t* b, int64_t N, float* out) {
  std::fill(out, out + n * N, 0.f);
  for (int64_t j0 = 0; j0 < N; j0 += kBlock) {
    const scalar_t* blk = b + j0 * K;
    const int64_t cols = std::min(kBlock, N - j0);
    for (int64_t k = 0; k < K; ++k) {
      const scalar_t* wk = blk + k * kBlock;
      for (int64_t m = 0; m < n; ++m) {
        const float am = a[m * K + k];
        float* om = out + m * N + j0;
        for (int64_t c = 0; c < cols; ++c) om[c] += am * static_cast<float>(wk[position<scalar_t>(c)]);
      }
    }
  }
}

#if defined(__AVX512F__) || defined(__AVX2__)
// The vector path, for float32 and bfloat16 weights alike: output rows kept in registers over all of K.
// For R rows and P blocks side by side, each step of k loads 2P weight vectors once and does 2PR FMAs into
// accumulators, with no loads or stores of the output until the end. Rows past what the registers hold
// go in further groups over the same blocks, which by then sit in L2 (48-192 KiB).
#ifdef __AVX512F__
using vec = __m512;
constexpr int64_t kWidth = 16;
constexpr int kGroupRows = 14;  // 14 x 2 accumulators + 2 weights + 1 broadcast <= 32 registers
constexpr int kPairRows = 6;  // two blocks: 6 x 4 accumulators + 4 weights + 1 broadcast
inline void load_pair(const c10::BFloat16* p, vec* w) {
  const __m512i x = _mm512_loadu_si512(p);
  w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  w[1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec splat(float x) { return _mm512_set1_ps(x); }
inline vec zero() { return _mm512_setzero_ps(); }
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
#else
using vec = __m256;
constexpr int64_t kWidth = 8;
constexpr int kGroupRows = 6;  // 6 x 2 accumulators + 2 weights + 1 broadcast <= 16 registers
constexpr int kPairRows = 0;  // two blocks: too few registers
inline void load_pair(const c10::BFloat16* p, vec* w) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  w[0] = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  w[1] = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec splat(float x) { return _mm256_set1_ps(x); }
inline vec zero() { return _mm256_setzero_ps(); }
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
#endif
// A tile: two vectors of columns, 2 x kWidth values of each block row (AVX-512: the whole block; AVX2:
// half of it), from position t x 2 x kWidth on.
constexpr int64_t kTiles = kBlock / (2 * kWidth);
static_assert(kBlock % (2 * kWidth) == 0 && kBlock == 32, "a block is whole tiles; bf16 pairs c with c + 16");

// the block column of tile t's vector v
template <typename scalar_t>
constexpr int64_t column(int64_t t, int v) {
  if constexpr (kPaired<scalar_t>) return t * kWidth + v * (kBlock / 2);
  return (2 * t + v) * kWidth;
}

// out[r, j0 + tile t's columns of P blocks] = sum_k a[r, k] * those blocks' rows (only columns below N
// stored). Two blocks (two streams) at a time give each broadcast of a[r, k] 4 FMAs instead of 2: with
// one, batch 32 (~8 rows an expert) was bound by the broadcasts, 0.72-0.89x the old layout's speed.
template <int R, int P, typename scalar_t>
inline void tile(const float* a, int64_t K, const scalar_t* blk, int64_t t, float* out, int64_t N, int64_t j0) {
  constexpr int V = 2 * P;
  vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = zero();
  const scalar_t* w = blk + t * 2 * kWidth;
  const int64_t next = K * kBlock;  // the second block
  for (int64_t k = 0; k < K; ++k, w += kBlock) {
    vec wv[V];
    for (int p = 0; p < P; ++p) {
      if constexpr (kPaired<scalar_t>) {
        load_pair(w + p * next, wv + 2 * p);
      } else {
        wv[2 * p] = load(w + p * next);
        wv[2 * p + 1] = load(w + p * next + kWidth);
      }
    }
    for (int r = 0; r < R; ++r) {
      const vec ar = splat(a[r * K + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = fma(ar, wv[v], acc[r][v]);
    }
  }
  const int64_t c0 = column<scalar_t>(t, 0), c1 = column<scalar_t>(t, 1);
  if (N - j0 >= P * kBlock) {
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) {
        store(out + r * N + j0 + p * kBlock + c0, acc[r][2 * p]);
        store(out + r * N + j0 + p * kBlock + c1, acc[r][2 * p + 1]);
      }
    return;
  }
  // the last block's zero padding is computed, never stored (acc is indexed only by constants, as above:
  // any other use keeps it in memory, stored on every step of k)
  alignas(64) float tmp[R][V][kWidth];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store(tmp[r][v], acc[r][v]);
  const int64_t valid = N - j0;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      const int64_t c = (v / 2) * kBlock + (v % 2 == 0 ? c0 : c1);
      if (c < valid) std::copy_n(tmp[r][v], std::min(kWidth, valid - c), out + r * N + j0 + c);
    }
}

template <int R, int P, typename scalar_t>
inline void group_dispatch(int64_t rows, const float* a, int64_t K, const scalar_t* blk, float* out, int64_t N,
                           int64_t j0) {
  if constexpr (R <= (P == 1 ? kGroupRows : kPairRows)) {
    if (rows != R) return group_dispatch<R + 1, P>(rows, a, K, blk, out, N, j0);
    for (int64_t t = 0; t < kTiles; ++t) tile<R, P>(a, K, blk, t, out, N, j0);
  }
}

template <typename scalar_t>
inline void stream_vec(const float* a, int64_t n, int64_t K, const scalar_t* b, int64_t N, float* out) {
  for (int64_t j0 = 0; j0 < N;) {
    const scalar_t* blk = b + j0 * K;
    const bool pair = kPairRows > 0 && N - j0 > kBlock;  // two blocks left
    const int64_t most = pair ? kPairRows : kGroupRows;
    const int64_t groups = (n + most - 1) / most;  // past `most` rows, balanced groups over the same blocks
    for (int64_t g = 0, m = 0; g < groups; ++g) {
      const int64_t rows = (n - m) / (groups - g);
      if (pair) group_dispatch<1, 2>(rows, a + m * K, K, blk, out + m * N, N, j0);
      else group_dispatch<1, 1>(rows, a + m * K, K, blk, out + m * N, N, j0);
      m += rows;
    }
    j0 += pair ? 2 * kBlock : kBlock;
  }
}
#endif

template <typename scalar_t>
inline void stream(const float* a, int64_t n, int64_t K, const scalar_t* b, int64_t N, float* out) {
#if defined(__AVX512F__) || defined(__AVX2__)
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    return stream_vec(a, n, K, b, N, out);
  }
#endif
  stream_scalar(a, n, K, b, N, out);
}

// The blocked b back to a plain row-major [K, N], for a library GEMM.
template <typename scalar_t>
inline void unblock(const scalar_t* b, int64_t K, int64_t N, scalar_t* plain) {
  for (int64_t j0 = 0; j0 < N; j0 += kBlock) {
    const scalar_t* blk = b + j0 * K;
    const int64_t cols = std::min(kBlock, N - j0);
    for (int64_t k = 0; k < K; ++k) {
      if constexpr (kPaired<scalar_t>) {
        for (int64_t c = 0; c < cols; ++c) plain[k * N + j0 + c] = blk[k * kBlock + position<scalar_t>(c)];
      } else {
        std::copy_n(blk + k * kBlock, cols, plain + k * N + j0);
      }
    }
  }
}

template <typename scalar_t>
void experts(const at::Tensor& x, const int64_t* ids, const float* weights, int64_t K, const at::Tensor& w13b,
             const at::Tensor& w2b, at::Tensor& out) {
  const int64_t T = x.size(0), P = T * K;
  const int64_t E = w13b.size(0), D = w13b.size(2), I = w2b.size(2), I2 = 2 * I;
  const int64_t w13_stride = w13b[0].numel(), w2_stride = w2b[0].numel();  // one expert's blocks
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* w13p = w13b.data_ptr<scalar_t>();
  const scalar_t* w2p = w2b.data_ptr<scalar_t>();
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
        // the library wants plain [K, N] weights: each expert's are unblocked into a buffer kept per thread
        // (~1% of a 2048-token prefill step's expert time)
        thread_local std::vector<scalar_t> plain13, plain2;
        if (static_cast<int64_t>(plain13.size()) < D * I2) plain13.resize(D * I2);
        if (static_cast<int64_t>(plain2.size()) < I * D) plain2.resize(I * D);
        unblock(w13p + e * w13_stride, D, I2, plain13.data());
        unblock(w2p + e * w2_stride, I, D, plain2.data());
        const at::Tensor g = gemm(rows, at::from_blob(plain13.data(), at::IntArrayRef{D, I2}, x.options()));
        const at::Tensor act = at::silu(g.narrow(1, 0, I)).mul_(g.narrow(1, I, I));
        const at::Tensor down =
            gemm(act, at::from_blob(plain2.data(), at::IntArrayRef{I, D}, x.options())).to(at::kFloat).contiguous();
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
      stream(a.data(), n, D, w13p + e * w13_stride, I2, gu.data());
      const float* hp = h.data();
      at::Tensor act;  // many rows (a prefill): torch's vectorised SiLU, not one std::exp per value
      if (n > kDecodeRows) {
        const at::Tensor g = at::from_blob(gu.data(), {n, I2}, x.options().dtype(at::kFloat));
        act = at::silu(g.narrow(1, 0, I)).mul_(g.narrow(1, I, I));
        hp = act.data_ptr<float>();
      } else {
        for (int64_t m = 0; m < n; ++m) {
          const float* g = gu.data() + m * I2;
          for (int64_t i = 0; i < I; ++i) h[m * I + i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
        }
      }
      stream(hp, n, I, w2p + e * w2_stride, D, ye);
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

int64_t moe_block_columns() { return kBlock; }

at::Tensor moe_experts(at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor w13b, at::Tensor w2b) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, D]");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "ids must be contiguous int64 [T, K]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "weights must be contiguous float32 [T, K], like ids");
  TORCH_CHECK(w13b.dim() == 4 && w13b.is_contiguous() && w2b.dim() == 4 && w2b.is_contiguous() &&
                  w13b.size(3) == kBlock && w2b.size(3) == kBlock,
              "w13b [E, 2I/32, D, 32] and w2b [E, D/32, I, 32] must be contiguous blocked weights (block_experts)");
  const int64_t E = w13b.size(0), D = w13b.size(2), I = w2b.size(2);
  const auto blocks = [](int64_t n) { return (n + kBlock - 1) / kBlock; };
  TORCH_CHECK(x.size(1) == D && w2b.size(0) == E && w13b.size(1) == blocks(2 * I) && w2b.size(1) == blocks(D),
              "shapes differ: x [T, D], w13b [E, 2I/32, D, 32], w2b [E, D/32, I, 32]");
  TORCH_CHECK(x.scalar_type() == w13b.scalar_type() && w2b.scalar_type() == w13b.scalar_type(),
              "x and the weights must share a dtype");
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < ids.numel(); ++p)
    TORCH_CHECK(ip[p] >= 0 && ip[p] < E, "expert id ", ip[p], " is outside 0..", E - 1);
  auto out = at::empty({x.size(0), D}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "moe_experts", [&] {
    experts<scalar_t>(x, ip, weights.data_ptr<float>(), ids.size(1), w13b, w2b, out);
  });
  return out;
}

}  // namespace composer
