// The CPU kernels as one Python extension module (kernels/cpu_ext.py builds it once per machine).

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

namespace composer {
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor tables,
                                  at::Tensor lens, int64_t block_size, double scale);
at::Tensor moe_experts(at::Tensor x, at::Tensor ids, at::Tensor weights, at::Tensor w13t, at::Tensor w2t);
std::string moe_float32_gemm();
at::Tensor decode_layers(at::Tensor x, std::vector<at::Tensor> ln1, std::vector<at::Tensor> ln2,
                         std::vector<at::Tensor> qkv_w, std::vector<at::Tensor> o_w, std::vector<at::Tensor> gate_w,
                         std::vector<int64_t> packed, std::vector<at::Tensor> q_norm, std::vector<at::Tensor> k_norm,
                         std::vector<at::Tensor> w13t, std::vector<at::Tensor> w2t, std::vector<at::Tensor> k_caches,
                         std::vector<at::Tensor> v_caches, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                         at::Tensor tables, at::Tensor lens, std::optional<at::Tensor> routes, double eps,
                         int64_t num_heads, int64_t top_k, bool norm_topk, double scale, int64_t block_size);
at::Tensor attention_prologue(at::Tensor qkv, at::Tensor q_norm, at::Tensor k_norm, double eps, at::Tensor cos,
                              at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots,
                              int64_t num_heads);
}  // namespace composer

// The kernels touch no Python object, so each lets go of the GIL while it runs (as torch's own ops do):
// a server's event loop then streams tokens during a decode step's experts and attention instead of
// waiting for them, and the engine thread does not wait for the event loop afterwards.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &composer::paged_decode_attention, py::call_guard<py::gil_scoped_release>(),
        "decode attention reading the paged KV cache in place (paged_attention_cpu.cpp)");
  m.def("attention_prologue", &composer::attention_prologue, py::call_guard<py::gil_scoped_release>(),
        "q/k RMSNorm, rotary embedding and the KV-cache write of one attention layer (attention_prologue_cpu.cpp)");
  m.def("moe_experts", &composer::moe_experts, py::call_guard<py::gil_scoped_release>(),
        "a MoE layer's routed experts, router output in, layer output out (moe_cpu.cpp)");
  m.def("decode_layers", &composer::decode_layers, py::call_guard<py::gil_scoped_release>(),
        "every decoder layer of a decode step, as the Python forward runs them (decode_layers_cpu.cpp)");
  m.def("moe_float32_gemm", &composer::moe_float32_gemm,
        "the GEMM moe_experts gives float32 experts with many rows: \"onednn\" or \"mm\" (moe_cpu.cpp)");
}
