#pragma once
// How torch_sac names an op overload in messages: "aten::mm.default", the
// spelling of torch.ops.aten.mm.default.

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>

namespace torch_sac {

inline std::string op_display_name(const c10::OperatorName& name) {
  return name.name + "." + (name.overload_name.empty() ? "default" : name.overload_name);
}

inline std::string op_display_name(const c10::OperatorHandle& op) {
  return op_display_name(op.operator_name());
}

} // namespace torch_sac
