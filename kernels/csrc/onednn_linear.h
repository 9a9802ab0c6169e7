// oneDNN's linear op (the one torch's CPU linear fusion uses), found once through the dispatcher: torch
// does not export oneDNN itself. Absent from torch builds without oneDNN.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>

namespace composer {

using OnednnLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                c10::string_view, c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);

inline const std::optional<c10::TypedOperatorHandle<OnednnLinear>>& onednn_linear() {
  static const auto linear = []() -> std::optional<c10::TypedOperatorHandle<OnednnLinear>> {
    auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!handle) return std::nullopt;
    return handle->typed<OnednnLinear>();
  }();
  return linear;
}

// y = x @ w^T (+ b), w [N, K] plain or packed for oneDNN (kernels/cpu_pack.py), as F.linear / PackedLinear.
inline at::Tensor onednn_linear_call(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  return onednn_linear()->call(x, w, b, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

}  // namespace composer
