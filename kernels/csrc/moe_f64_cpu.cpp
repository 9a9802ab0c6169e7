// A MoE layer's routed experts for a few float64 rows (a batch-1 decode, a verified draft) on a CPU, in
// float64 throughout: out[t] = sum over t's experts e, in ascending order, of weights[t, e] * w2[e]
// (silu(gate_e x[t]) * up_e x[t]).
//
// x [T, D], ids [T, K] int64, weights [T, K], w13 [E, 2I, D] (gate rows, then up rows) and w2 [E, D, I]
// as the checkpoint holds them (row-major, contiguous), all float64; D and I multiples of 8. Returns [T, D].
//
// Why: the built-in model is served in float64 (greedy output the same on every CPU), which the float32
// expert kernel (moe_cpu.cpp) cannot take, so its experts ran torch's grouped path: a sort, gathers, two
// matmuls per expert hit and a SwiGLU, weighting and index_add, ~15 ops whose dispatch, not arithmetic,
// made up a quarter of a decode step, and each extra row of a verified draft hit new experts, two more
// matmul calls each. Here each expert with rows streams its weight rows once, every row of the expert
// dotted with each of its tokens (vector FMAs, two chains), and each token's sum is taken in ascending
// expert order, as the grouped path sums. A token's result depends on nothing else in the batch.

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "vec_f64.h"

namespace composer {
namespace {

using f64::loadv;
using f64::vd;
using f64::VW;

inline double hsum(vd v) {
  double s = 0.0;
  for (int64_t j = 0; j < VW; ++j) s += v[j];
  return s;
}

// dot products of one weight row (n values) with `rows` input rows (each n values, `stride` apart)
inline void dots(const double* w, const double* x, int64_t stride, int64_t rows, int64_t n, double* out) {
  constexpr int64_t kRows = 4;  // input rows per pass over the weight row: the row is read from L1 after
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t nr = std::min(kRows, rows - r0);
    vd a[kRows][2] = {};
    for (int64_t c = 0; c < n; c += 2 * VW) {
      const vd w0 = loadv(w + c), w1 = c + VW < n ? loadv(w + c + VW) : vd{};
      for (int64_t r = 0; r < kRows; ++r) {
        if (r >= nr) break;
        const double* xr = x + (r0 + r) * stride + c;
        a[r][0] += w0 * loadv(xr);
        if (c + VW < n) a[r][1] += w1 * loadv(xr + VW);
      }
    }
    for (int64_t r = 0; r < nr; ++r) out[(r0 + r)] = hsum(a[r][0] + a[r][1]);
  }
}

}  // namespace

at::Tensor moe_experts_f64(at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor w13, at::Tensor w2) {
  TORCH_CHECK(x.scalar_type() == at::kDouble && weights.scalar_type() == at::kDouble &&
                  w13.scalar_type() == at::kDouble && w2.scalar_type() == at::kDouble, "float64 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w13.dim() == 3 && w13.is_contiguous() && w2.dim() == 3 &&
                  w2.is_contiguous(), "x [T, D], w13 [E, 2I, D] and w2 [E, D, I] must be contiguous");
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.is_contiguous() && weights.sizes() == ids.sizes() &&
                  weights.is_contiguous() && ids.size(0) == x.size(0), "ids (int64) and weights must be [T, K]");
  const int64_t T = x.size(0), D = x.size(1), K = ids.size(1), E = w13.size(0), I = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == D && w2.size(0) == E && w2.size(1) == D,
              "w13 must be [E, 2I, D] and w2 [E, D, I] for x's D");
  TORCH_CHECK(D % 8 == 0 && I % 8 == 0, "D and I must be multiples of 8");
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < T * K; ++p) TORCH_CHECK(id[p] >= 0 && id[p] < E, "expert ", id[p], " outside 0..", E - 1);
  const double* xp = x.data_ptr<double>();
  const double* wt = weights.data_ptr<double>();
  const double* a13 = w13.data_ptr<double>();
  const double* a2 = w2.data_ptr<double>();
  // pairs (token, k) grouped by expert
  std::vector<std::vector<int64_t>> pairs(E);
  for (int64_t p = 0; p < T * K; ++p) pairs[id[p]].push_back(p);
  std::vector<double> y(T * K * D), xs, gu, h, col;
  for (int64_t e = 0; e < E; ++e) {
    const auto& ps = pairs[e];
    const int64_t n = static_cast<int64_t>(ps.size());
    if (!n) continue;
    xs.resize(n * D);
    for (int64_t r = 0; r < n; ++r) std::memcpy(xs.data() + r * D, xp + (ps[r] / K) * D, D * sizeof(double));
    gu.resize(2 * I * n);  // [2I, n]: weight row j's dot with each token
    for (int64_t j = 0; j < 2 * I; ++j) dots(a13 + (e * 2 * I + j) * D, xs.data(), D, n, D, gu.data() + j * n);
    h.resize(n * I);  // [n, I]: silu(gate) * up per token
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < I; ++i) {
        const double g = gu[i * n + r], u = gu[(I + i) * n + r];
        h[r * I + i] = g / (1.0 + std::exp(-g)) * u;
      }
    col.resize(n);
    for (int64_t d = 0; d < D; ++d) {
      dots(a2 + (e * D + d) * I, h.data(), I, n, I, col.data());
      for (int64_t r = 0; r < n; ++r) y[ps[r] * D + d] = col[r];
    }
  }
  auto out = at::zeros({T, D}, x.options());
  double* o = out.data_ptr<double>();
  std::vector<int64_t> order(K);
  for (int64_t t = 0; t < T; ++t) {  // each token's experts summed in ascending expert order
    for (int64_t k = 0; k < K; ++k) order[k] = k;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return id[t * K + a] < id[t * K + b]; });
    for (int64_t k : order) {
      const double w = wt[t * K + k];
      const double* yr = y.data() + (t * K + k) * D;
      for (int64_t d = 0; d < D; ++d) o[t * D + d] += yr[d] * w;
    }
  }
  return out;
}

}  // namespace composer
