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
// counted and sorted by expert; an expert with few rows reads each weight row once, contiguously, and
// updates its few output rows (which stay in L1) from it; an expert with many rows (prefill) goes to
// at::mm, which is compute-bound there and does it best. Experts are split over the intra-op threads,
// so two cores stream two experts at once. Each token's expert outputs are then summed in ascending
// expert order (as the torch grouped path does), so the result does not depend on the thread count.
// Accumulation is in float32.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/silu.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace composer {
namespace {

constexpr int64_t kStreamRows = 16;  // at most this many rows per expert: the streaming loop; more: at::mm

// out[m, :] = sum_k a[m, k] * b[k, :] for m < n (n <= kStreamRows), b [K, N] row-major. Four weight
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
  at::parallel_for(0, E, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard;  // thread-local: a worker thread's at::mm must not build autograd state
    std::vector<float> a(kStreamRows * D), gu(kStreamRows * I2), h(kStreamRows * I);
    for (int64_t e = begin; e < end; ++e) {
      const int64_t s = offsets[e], n = offsets[e + 1] - s;
      if (n == 0) continue;  // never read an expert no token chose
      float* ye = y + s * D;
      if (n > kStreamRows) {  // many rows: a library GEMM is compute-bound and better at it
        auto rows = at::empty({n, D}, x.options());
        scalar_t* rp = rows.data_ptr<scalar_t>();
        for (int64_t m = 0; m < n; ++m) std::copy_n(xp + (sorted[s + m] / K) * D, D, rp + m * D);
        auto g = at::mm(rows, w13t[e]);
        auto act = at::silu(g.narrow(1, 0, I)).mul_(g.narrow(1, I, I));
        auto down = at::mm(act, w2t[e]).to(at::kFloat).contiguous();
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
      stream_rows(a.data(), n, D, w13p + e * D * I2, I2, gu.data());
      for (int64_t m = 0; m < n; ++m) {
        const float* g = gu.data() + m * I2;
        for (int64_t i = 0; i < I; ++i) h[m * I + i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
      }
      stream_rows(h.data(), n, I, w2p + e * I * D, D, ye);
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
