// The routed experts of a MoE layer on a CPU, all experts in one call: for (token, expert) pairs
// already sorted by expert, y[p] = w2[e] (silu(gate_e x[p]) * up_e x[p]).
//
// x [P, D] (the pairs' rows, grouped by expert), offsets [E + 1] int64 (expert e's pairs are rows
// offsets[e]..offsets[e+1]), w13t [E, D, 2I] and w2t [E, I, D] contiguous (input-major: the
// transposes of the checkpoint's [E, 2I, D] gate_up and [E, D, I] down). Returns y [P, D] in x's dtype.
//
// Why: a decode step gives each expert a handful of rows, so each expert's matmuls are bound by
// streaming its weights from memory. A library sgemm at 2-8 rows streams well below memory bandwidth
// and costs a dispatch per call (two per expert). Here an expert with few rows reads each weight row
// once, contiguously, and updates its few output rows (which stay in L1) from it; an expert with many
// rows (prefill) goes to at::mm, which is compute-bound there and does it best. Experts are split over
// the intra-op threads, so two cores stream two experts at once. Accumulation is in float32.

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
void experts(const at::Tensor& x, const int64_t* offsets, const at::Tensor& w13t, const at::Tensor& w2t,
             at::Tensor& y) {
  const int64_t E = w13t.size(0), D = w13t.size(1), I2 = w13t.size(2), I = I2 / 2;
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* w13p = w13t.data_ptr<scalar_t>();
  const scalar_t* w2p = w2t.data_ptr<scalar_t>();
  scalar_t* yp = y.data_ptr<scalar_t>();
  at::parallel_for(0, E, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard;  // thread-local: a worker thread's at::mm must not build autograd state
    std::vector<float> a(kStreamRows * D), gu(kStreamRows * I2), h(kStreamRows * I), out(kStreamRows * D);
    for (int64_t e = begin; e < end; ++e) {
      const int64_t s = offsets[e], n = offsets[e + 1] - s;
      if (n == 0) continue;  // never read an expert no token chose
      if (n > kStreamRows) {  // many rows: a library GEMM is compute-bound and better at it
        auto g = at::mm(x.narrow(0, s, n), w13t[e]);
        auto act = at::silu(g.narrow(1, 0, I)).mul_(g.narrow(1, I, I));
        y.narrow(0, s, n).copy_(at::mm(act, w2t[e]));
        continue;
      }
      for (int64_t i = 0; i < n * D; ++i) a[i] = static_cast<float>(xp[s * D + i]);
      stream_rows(a.data(), n, D, w13p + e * D * I2, I2, gu.data());
      for (int64_t m = 0; m < n; ++m) {
        const float* g = gu.data() + m * I2;
        for (int64_t i = 0; i < I; ++i) h[m * I + i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
      }
      stream_rows(h.data(), n, I, w2p + e * I * D, D, out.data());
      for (int64_t i = 0; i < n * D; ++i) yp[s * D + i] = static_cast<scalar_t>(out[i]);
    }
  });
}

}  // namespace

at::Tensor grouped_experts(at::Tensor x, at::Tensor offsets, at::Tensor w13t, at::Tensor w2t) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [P, D]");
  TORCH_CHECK(w13t.dim() == 3 && w13t.is_contiguous() && w2t.dim() == 3 && w2t.is_contiguous(),
              "w13t [E, D, 2I] and w2t [E, I, D] must be contiguous");
  const int64_t E = w13t.size(0), D = w13t.size(1), I2 = w13t.size(2);
  TORCH_CHECK(x.size(1) == D && I2 % 2 == 0 && w2t.size(0) == E && w2t.size(1) == I2 / 2 && w2t.size(2) == D,
              "shapes differ: x [P, D], w13t [E, D, 2I], w2t [E, I, D]");
  TORCH_CHECK(x.scalar_type() == w13t.scalar_type() && w2t.scalar_type() == w13t.scalar_type(),
              "x and the weights must share a dtype");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) == E + 1 && offsets.scalar_type() == at::kLong &&
                  offsets.is_contiguous(), "offsets must be contiguous int64 [E + 1]");
  const int64_t* o = offsets.data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0 && o[E] == x.size(0), "offsets must run from 0 to P");
  for (int64_t e = 0; e < E; ++e) TORCH_CHECK(o[e] <= o[e + 1], "offsets must not decrease");
  auto y = at::empty({x.size(0), D}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "grouped_experts",
                                  [&] { experts<scalar_t>(x, o, w13t, w2t, y); });
  return y;
}

}  // namespace composer
