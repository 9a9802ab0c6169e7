// A MoE layer's routed experts for a few float64 rows (a batch-1 decode, a verified draft) on a CPU, in
// float64 throughout: out[t] = sum over t's experts e, in ascending order, of weights[t, e] * w2[e]
// (silu(gate_e x[t]) * up_e x[t]).
//
// x [T, D], ids [T, K] int64, weights [T, K] float64; w13 [E, 2I, D] (gate rows, then up rows) and w2
// [E, D, I] as the checkpoint holds them (row-major, contiguous), float64, or float32 or bfloat16 holding
// the same values exactly (both one dtype: widened to float64 in registers as they are read, so the sums
// are those of float64 weights, bit for bit); D and I multiples of 8. Returns [T, D].
//
// Why: the built-in model is served in float64 (greedy output the same on every CPU), which the float32
// expert kernel (moe_cpu.cpp) cannot take, so its experts ran torch's grouped path: a sort, gathers, two
// matmuls per expert hit and a SwiGLU, weighting and index_add, ~15 ops whose dispatch, not arithmetic,
// made up a quarter of a decode step, and each extra row of a verified draft hit new experts, two more
// matmul calls each. Here each expert with rows streams its weight rows once, eight at a time dotted with
// each of its tokens (f64::dots: sixteen FMA chains side by side), and each token's sum is taken in
// ascending expert order, as the grouped path sums. A token's result depends on nothing else in the batch.
//
// The narrower weights: every step reads its experts' weights from memory (a step's other weights and the
// KV cache evict them), so the bytes a weight takes set the time a new expert costs. MXFP8 experts hold
// 4-bit significands, which bfloat16 holds exactly: a quarter of float64's bytes for the same sums.

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec_f64.h"

namespace composer {
namespace {

using f64::dots;
using f64::storev;
using f64::VW;

// f(w, r) for each of an expert's n tokens r, w: VW weight rows of `len` values. One or two tokens read
// them as stored (widened in registers); three or more read one float64 copy made in L1 first, so that
// the widening (shuffles and converts per vector, which bound the dots at ~3 cycles a vector FMA) is paid
// once per weight rows, not once per token (for two, the copy's stores and loads cost what they save).
// The kernel alone: 0.77-0.91x at 5-9 tokens on two experts, 0.95-1.01x on random ones
// (bench/serve-results/experts_kernel_ab.log). Widening is exact: the same sums, bit for bit.
template <typename W, typename F>
inline void each_token(const W* w, int64_t len, int64_t n, F&& f) {
  if (std::is_same_v<W, double> || n <= 2) {
    for (int64_t r = 0; r < n; ++r) f(w, r);
    return;
  }
  thread_local std::vector<double> wide;
  wide.resize(VW * len);
  for (int64_t i = 0; i < VW * len; i += VW) storev(wide.data() + i, f64::widen(w + i));
  for (int64_t r = 0; r < n; ++r) f(static_cast<const double*>(wide.data()), r);
}

template <typename W>
at::Tensor experts(const at::Tensor& x, const int64_t* id, const double* xp, const double* wt, const W* a13,
                   const W* a2, int64_t T, int64_t D, int64_t K, int64_t E, int64_t I) {
  // pairs (token, k) grouped by expert
  std::vector<std::vector<int64_t>> pairs(E);
  for (int64_t p = 0; p < T * K; ++p) pairs[id[p]].push_back(p);
  std::vector<double> y(T * K * D), xs, gu, h;
  for (int64_t e = 0; e < E; ++e) {
    const auto& ps = pairs[e];
    const int64_t n = static_cast<int64_t>(ps.size());
    if (!n) continue;
    xs.resize(n * D);
    for (int64_t r = 0; r < n; ++r) std::memcpy(xs.data() + r * D, xp + (ps[r] / K) * D, D * sizeof(double));
    gu.resize(n * 2 * I);  // [n, 2I]: each token's dots with the gate rows, then the up rows
    for (int64_t j = 0; j < 2 * I; j += VW)  // VW weight rows at a time (read from L1 for the 2nd token on)
      each_token(a13 + (e * 2 * I + j) * D, D, n, [&](const auto* w, int64_t r) {
        storev(gu.data() + r * 2 * I + j, dots(w, xs.data() + r * D, D));
      });
    h.resize(n * I);  // [n, I]: silu(gate) * up per token
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < I; ++i) {
        const double g = gu[r * 2 * I + i], u = gu[r * 2 * I + I + i];
        h[r * I + i] = g / (1.0 + std::exp(-g)) * u;
      }
    for (int64_t d = 0; d < D; d += VW)
      each_token(a2 + (e * D + d) * I, I, n, [&](const auto* w, int64_t r) {
        storev(y.data() + ps[r] * D + d, dots(w, h.data() + r * I, I));
      });
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

}  // namespace

at::Tensor moe_experts_f64(at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor w13, at::Tensor w2) {
  const auto wt_type = w13.scalar_type();
  TORCH_CHECK(x.scalar_type() == at::kDouble && weights.scalar_type() == at::kDouble &&
                  (wt_type == at::kDouble || wt_type == at::kFloat || wt_type == at::kBFloat16) &&
                  w2.scalar_type() == wt_type,
              "float64 only (x, weights), the experts' weights float64, float32 or bfloat16 (one dtype)");
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
  switch (wt_type) {
    case at::kFloat: return experts(x, id, xp, wt, w13.data_ptr<float>(), w2.data_ptr<float>(), T, D, K, E, I);
    case at::kBFloat16:
      return experts(x, id, xp, wt, w13.data_ptr<at::BFloat16>(), w2.data_ptr<at::BFloat16>(), T, D, K, E, I);
    default: return experts(x, id, xp, wt, w13.data_ptr<double>(), w2.data_ptr<double>(), T, D, K, E, I);
  }
}

}  // namespace composer
