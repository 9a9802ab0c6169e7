// Every decoder layer of a Qwen3-MoE decode step on a CPU, in one call: the same ATen ops and kernels,
// in the same order, as the model's Python forward (serve/model/qwen3_moe.py) runs for a step where
// every row decodes, so the result is the same to the bit.
//
// Per layer: h = RMSNorm(x); qkv = linear(h); q = attention_prologue(qkv, ...) (q/k norms, rotary, KV
// write); o = paged_decode_attention(q, ...); x += linear(o); h = RMSNorm(x); router softmax, top-k
// (renormalised if the model says so), the routes recorded; x += moe_experts(h, ...).
//
// Why: with the attention, experts and projections in kernels, what was left of a decode step was
// Python: ~35 op calls and a dozen module calls per layer, each a few microseconds of interpreter and
// argument parsing (about a tenth of a 32-row step). Called from C++ they cost a dispatch each, and the
// whole stack runs without the GIL, so a server's event loop streams tokens meanwhile.
//
// x [B, D]; per layer l (lists of L): ln1[l], ln2[l] [D]; qkv_w[l], o_w[l], gate_w[l]: plain [N, K] or
// oneDNN-packed weights (packed[3l + 0..2] says which); q_norm[l], k_norm[l] [C] float32; w13b[l], w2b[l]
// the experts, blocked as moe_experts takes them; k_caches[l], v_caches[l] [S, G, C]. cos, sin [B, C];
// slots [B]; tables [B, N], lens [B] int64; routes [S, L, K] int16 or undefined (not recorded).

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "kernels.h"
#include "onednn_linear.h"

namespace composer {

namespace {

// RMSNorm.forward (serve/model/layers.py), op for op
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  auto x32 = x.to(at::kFloat);
  x32 = x32 * at::rsqrt(x32.pow(2).mean({-1}, true) + eps);
  return w * x32.to(x.scalar_type());
}

// nn.Linear (no bias) or PackedLinear (kernels/cpu_pack.py), as their forwards call them
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, bool packed) {
  if (packed) return onednn_linear_call(x.contiguous(), w, std::nullopt);
  return at::linear(x, w);
}

}  // namespace

at::Tensor decode_layers(at::Tensor x, std::vector<at::Tensor> ln1, std::vector<at::Tensor> ln2,
                         std::vector<at::Tensor> qkv_w, std::vector<at::Tensor> o_w, std::vector<at::Tensor> gate_w,
                         std::vector<int64_t> packed, std::vector<at::Tensor> q_norm, std::vector<at::Tensor> k_norm,
                         std::vector<at::Tensor> w13b, std::vector<at::Tensor> w2b, std::vector<at::Tensor> k_caches,
                         std::vector<at::Tensor> v_caches, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                         at::Tensor tables, at::Tensor lens, std::optional<at::Tensor> routes, double eps,
                         int64_t num_heads, int64_t top_k, bool norm_topk, double scale, int64_t block_size) {
  const size_t L = ln1.size();
  for (const auto* list : {&ln2, &qkv_w, &o_w, &gate_w, &q_norm, &k_norm, &w13b, &w2b, &k_caches, &v_caches})
    TORCH_CHECK(list->size() == L, "decode_layers: every per-layer list must have ", L, " entries");
  TORCH_CHECK(packed.size() == 3 * L, "decode_layers: packed needs 3 flags per layer (q/k/v, o, router)");
  TORCH_CHECK(x.dim() == 2 && slots.dim() == 1 && slots.size(0) == x.size(0), "decode_layers: x [B, D], slots [B]");
  TORCH_CHECK(std::find(packed.begin(), packed.end(), 1) == packed.end() || onednn_linear(),
              "decode_layers: packed weights need torch's oneDNN");
  c10::InferenceMode guard;
  const auto dtype = x.scalar_type();
  for (size_t l = 0; l < L; ++l) {
    const int64_t B = x.size(0);
    auto h = rms_norm(x, ln1[l], eps);
    auto qkv = linear(h, qkv_w[l], packed[3 * l]);
    auto q = attention_prologue(qkv, q_norm[l], k_norm[l], eps, cos, sin, k_caches[l], v_caches[l], slots, num_heads);
    auto o = paged_decode_attention(q, k_caches[l], v_caches[l], tables, lens, block_size, scale);
    x = x + linear(o.reshape({B, -1}), o_w[l], packed[3 * l + 1]);
    h = rms_norm(x, ln2[l], eps);
    auto logits = linear(h, gate_w[l], packed[3 * l + 2]);
    auto probs = at::softmax(logits, -1, at::kFloat);
    auto [weights, ids] = at::topk(probs, top_k, -1);
    if (routes && routes->defined())
      routes->select(1, static_cast<int64_t>(l)).index_put_({slots}, ids.to(routes->scalar_type()));
    if (norm_topk) weights = weights / weights.sum({-1}, true);
    weights = weights.to(logits.scalar_type());
    x = x + moe_experts(h.contiguous(), ids.to(at::kLong).contiguous(), weights.to(at::kFloat).contiguous(), w13b[l],
                        w2b[l]);
    TORCH_CHECK(x.scalar_type() == dtype, "decode_layers: the residual stream changed dtype");
  }
  return x;
}

}  // namespace composer
