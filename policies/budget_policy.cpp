#include "policies/budget_policy.h"

#include <c10/util/Exception.h>

namespace torch_sac::policies {

SavedCallsPolicy::SavedCallsPolicy(const std::vector<SavedCall>& calls, std::string label)
    : label_(std::move(label)) {
  for (const auto& c : calls) {
    TORCH_CHECK_VALUE(
        c.op.name.find("::") != std::string::npos, "torch_sac: op name '", c.op.name,
        "' must be qualified with its namespace, e.g. 'aten::mm'");
    TORCH_CHECK_VALUE(
        c.call_index >= 0, "torch_sac: call index must be >= 0, got ", c.call_index, " for ",
        c.op.name);
    auto handle = c10::Dispatcher::singleton().findOp(c.op);
    auto& indices = handle ? by_handle_[*handle] : by_name_[c.op];
    if (indices.size() <= static_cast<size_t>(c.call_index)) {
      indices.resize(c.call_index + 1, false);
    }
    if (!indices[c.call_index]) {
      indices[c.call_index] = true;
      ++size_;
    }
  }
}

Policy SavedCallsPolicy::decide(const OpCall& call) {
  if (auto it = by_handle_.find(call.op); it != by_handle_.end()) {
    return saved(it->second, call.call_index) ? Policy::MustSave : Policy::PreferRecompute;
  }
  if (!by_name_.empty()) {
    if (auto it = by_name_.find(call.op.operator_name()); it != by_name_.end()) {
      return saved(it->second, call.call_index) ? Policy::MustSave : Policy::PreferRecompute;
    }
  }
  return Policy::PreferRecompute;
}

std::string SavedCallsPolicy::describe() const {
  return label_.empty() ? "save_calls(" + std::to_string(size_) + " calls)" : label_;
}

std::shared_ptr<SavedCallsPolicy> save_calls(
    const std::vector<SavedCall>& calls,
    std::string label) {
  return std::make_shared<SavedCallsPolicy>(calls, std::move(label));
}

} // namespace torch_sac::policies
