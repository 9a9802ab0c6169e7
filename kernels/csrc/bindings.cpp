// The CPU kernels as one Python extension module (kernels/cpu_ext.py builds it once per machine).

#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

// The kernels touch no Python object, so each lets go of the GIL while it runs (as torch's own ops do):
// a server's event loop then streams tokens during a decode step's experts and attention instead of
// waiting for them, and the engine thread does not wait for the event loop afterwards.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &composer::paged_decode_attention, py::call_guard<py::gil_scoped_release>(),
        "decode attention reading the paged KV cache in place (paged_attention_cpu.cpp)");
  m.def("few_query_attention", &composer::few_query_attention, py::call_guard<py::gil_scoped_release>(),
        "one sequence's last few queries over its paged keys, in float64 (few_query_attention_cpu.cpp)");
  m.def("attention_prologue", &composer::attention_prologue, py::call_guard<py::gil_scoped_release>(),
        "q/k RMSNorm, rotary embedding and the KV-cache write of one attention layer (attention_prologue_cpu.cpp)");
  m.def("moe_experts", &composer::moe_experts, py::call_guard<py::gil_scoped_release>(),
        "a MoE layer's routed experts, router output in, layer output out (moe_cpu.cpp)");
  m.def("moe_experts_f64", &composer::moe_experts_f64, py::call_guard<py::gil_scoped_release>(),
        "a MoE layer's routed experts for a few float64 rows, plain [E, 2I, D] / [E, D, I] weights (moe_f64_cpu.cpp)");
  m.def("linear_f64", &composer::linear_f64, py::call_guard<py::gil_scoped_release>(),
        "x·wᵀ for a few float64 rows (linear_f64_cpu.cpp)");
  m.def("decode_layers", &composer::decode_layers, py::call_guard<py::gil_scoped_release>(),
        "every decoder layer of a decode step, as the Python forward runs them (decode_layers_cpu.cpp)");
  m.def("moe_block_columns", &composer::moe_block_columns,
        "the column block of the expert weights moe_experts takes (moe_cpu.cpp, kernels/moe.py's block_experts)");
  m.def("moe_float32_gemm", &composer::moe_float32_gemm,
        "the GEMM moe_experts gives float32 experts with many rows: \"onednn\" or \"mm\" (moe_cpu.cpp)");
}
