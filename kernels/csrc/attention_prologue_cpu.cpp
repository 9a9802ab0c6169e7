// What a Qwen3 attention layer does between its fused q/k/v projection and attention itself, in one
// pass per token on a CPU: RMSNorm of each query and key head (q_norm, k_norm), rotary embedding of
// both (rotate-half form), and the new key and value written into the paged KV cache.
//
// qkv [T, (H + 2G) * C] (rows contiguous), q_norm and k_norm weights [C] float32, cos and sin [T, C]
// (attention scaling already applied), k_cache and v_cache [S, G, C] contiguous, slots [T] int64.
// Returns q [T, H, C] in qkv's dtype; the caches are written in place.
//
// Why: in torch this is ~25 small ops per layer (split, two norms of 6 ops, two rotations of 5, two
// cache copies), each a dispatch and a pass over memory; a decode step at batch 8 spends more on their
// overhead than on their arithmetic. Norms are computed in float32 as RMSNorm does.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <vector>

namespace composer {
namespace {

// y = rope(w * x / rms(x)) for one head of C values, into out (float32 math throughout).
template <typename scalar_t>
inline void norm_rope(const scalar_t* x, const float* w, float eps, const scalar_t* cos, const scalar_t* sin,
                      int64_t C, float* tmp, scalar_t* out) {
  float ss = 0.f;
  for (int64_t c = 0; c < C; ++c) {
    const float v = static_cast<float>(x[c]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(C) + eps);
  for (int64_t c = 0; c < C; ++c) tmp[c] = w[c] * static_cast<float>(static_cast<scalar_t>(static_cast<float>(x[c]) * r));
  const int64_t half = C / 2;
  for (int64_t c = 0; c < C; ++c) {
    const float rot = c < half ? -tmp[c + half] : tmp[c - half];
    const float cs = static_cast<float>(cos[c]), sn = static_cast<float>(sin[c]);
    out[c] = static_cast<scalar_t>(tmp[c] * cs + rot * sn);
  }
}

}  // namespace

at::Tensor attention_prologue(at::Tensor qkv, at::Tensor q_norm, at::Tensor k_norm, double eps, at::Tensor cos,
                              at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                              int64_t num_heads) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous(), "k_cache and v_cache must be contiguous [S, G, C]");
  const int64_t T = qkv.size(0), G = k_cache.size(1), C = k_cache.size(2), H = num_heads, S = k_cache.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (H + 2 * G) * C,
              "qkv must be [T, (H + 2G) * C] with contiguous rows");
  TORCH_CHECK(C % 2 == 0, "the head dim must be even for the rotary embedding");
  TORCH_CHECK(q_norm.numel() == C && k_norm.numel() == C && q_norm.scalar_type() == at::kFloat &&
                  k_norm.scalar_type() == at::kFloat && q_norm.is_contiguous() && k_norm.is_contiguous(),
              "q_norm and k_norm must be contiguous float32 [C]");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == C && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(), "cos and sin must be contiguous [T, C]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
                  k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "qkv, cos, sin and the caches must share a dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == T && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots must be contiguous int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "slot ", sp[t], " is outside the cache");
  auto q = at::empty({T, H, C}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, qkv.scalar_type(), "prologue", [&] {
    const scalar_t* x = qkv.data_ptr<scalar_t>();
    const int64_t row = qkv.stride(0);
    const float *qw = q_norm.data_ptr<float>(), *kw = k_norm.data_ptr<float>();
    const scalar_t *cp = cos.data_ptr<scalar_t>(), *snp = sin.data_ptr<scalar_t>();
    scalar_t *qp = q.data_ptr<scalar_t>(), *kc = k_cache.data_ptr<scalar_t>(), *vc = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(C);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* xt = x + t * row;
        for (int64_t h = 0; h < H; ++h)
          norm_rope(xt + h * C, qw, static_cast<float>(eps), cp + t * C, snp + t * C, C, tmp.data(), qp + (t * H + h) * C);
        for (int64_t g = 0; g < G; ++g) {
          norm_rope(xt + (H + g) * C, kw, static_cast<float>(eps), cp + t * C, snp + t * C, C, tmp.data(),
                    kc + (sp[t] * G + g) * C);
          const scalar_t* v = xt + (H + G + g) * C;
          std::copy(v, v + C, vc + (sp[t] * G + g) * C);
        }
      }
    });
  });
  return q;
}

}  // namespace composer
