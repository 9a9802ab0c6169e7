// x·wᵀ for a few float64 rows on a CPU (a batch-1 decode, a verified draft): the built-in model's
// projections and LM head as served, float64 throughout.
//
// x [R, D] and w [N, D] float64 contiguous; N and D multiples of 8. Returns [R, N].
//
// Why: torch ran these through MKL, whose fixed cost per call (F.linear's GEMV, or the GEMM on the weight
// as its long side that serve/model/numerics.by_weight calls) is most of the time at these sizes: with L2
// evicted between calls, a [256, 128] projection took 37-93 us at 1-9 rows where this takes 23-40, and the
// [4,096, 128] LM head 330-480 us where this takes 160-380; a step of the built-in model at 1,400 keys,
// 0.91-0.96x the time at 1-9 rows (bench/serve-results/linear_f64_ab.py). Here eight weight rows at a
// time are dotted with every row of x while they sit in L1 (f64::dots: sixteen FMA chains side by side).
// Each output is one weight row's dot with one row of x, summed in an order fixed by D alone: a row's
// result does not depend on R, so a decode and a verify of the same position agree to the bit.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cstdint>

#include "kernels.h"
#include "vec_f64.h"

namespace composer {

at::Tensor linear_f64(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kDouble && w.scalar_type() == at::kDouble, "float64 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 2 && w.is_contiguous() && x.size(1) == w.size(1),
              "x [R, D] and w [N, D] must be contiguous, with one D");
  const int64_t R = x.size(0), N = w.size(0), D = w.size(1);
  TORCH_CHECK(N % 8 == 0 && D % 8 == 0, "N and D must be multiples of 8, not ", N, " and ", D);
  auto out = at::empty({R, N}, x.options());
  const double* xp = x.data_ptr<double>();
  const double* wp = w.data_ptr<double>();
  double* o = out.data_ptr<double>();
  constexpr int64_t VW = f64::VW;
  at::parallel_for(0, N / VW, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = 0; r < R; ++r) f64::storev(o + r * N + b * VW, f64::dots(wp + b * VW * D, xp + r * D, D));
  });
  return out;
}

}  // namespace composer
