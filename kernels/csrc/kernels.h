// The CPU kernels' entry points (each file says what its kernel does and why), declared once for the
// Python bindings (bindings.cpp) and for kernels that call others (decode_layers_cpu.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace composer {
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                                  at::Tensor lens, int64_t block_size, double scale);
at::Tensor few_query_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots, double scale);
at::Tensor moe_experts(at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor w13b, at::Tensor w2b);
at::Tensor moe_experts_f64(at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor w13, at::Tensor w2);

// x·wᵀ for a few float64 rows (linear_f64_cpu.cpp).
at::Tensor linear_f64(at::Tensor x, at::Tensor w);
int64_t moe_block_columns();
std::string moe_float32_gemm();
at::Tensor attention_prologue(at::Tensor qkv, at::Tensor q_norm, at::Tensor k_norm, double eps, at::Tensor cos,
                              at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                              int64_t num_heads);
at::Tensor decode_layers(at::Tensor x, std::vector<at::Tensor> ln1, std::vector<at::Tensor> ln2,
                         std::vector<at::Tensor> qkv_w, std::vector<at::Tensor> o_w, std::vector<at::Tensor> gate_w,
                         std::vector<int64_t> packed, std::vector<at::Tensor> q_norm, std::vector<at::Tensor> k_norm,
                         std::vector<at::Tensor> w13b, std::vector<at::Tensor> w2b, std::vector<at::Tensor> k_caches,
                         std::vector<at::Tensor> v_caches, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                         at::Tensor tables, at::Tensor lens, std::optional<at::Tensor> routes, double eps,
                         int64_t num_heads, int64_t top_k, bool norm_topk, double scale, int64_t block_size);
}  // namespace composer
