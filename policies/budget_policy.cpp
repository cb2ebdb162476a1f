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
      indices.resize(c.call_index + 1, kNo);
    }
    const uint8_t listed = c.offload ? kOffload : kSave;
    TORCH_CHECK_VALUE(
        indices[c.call_index] == kNo || indices[c.call_index] == listed, "torch_sac: call ",
        c.call_index, " of ", c.op.name, " is listed both as saved and as offloaded");
    if (indices[c.call_index] == kNo) {
      indices[c.call_index] = listed;
      ++size_;
      offloaded_ += c.offload ? 1 : 0;
    }
  }
}

Policy SavedCallsPolicy::decide(const OpCall& call) {
  if (auto it = by_handle_.find(call.op); it != by_handle_.end()) {
    return decision(it->second, call.call_index);
  }
  if (!by_name_.empty()) {
    if (auto it = by_name_.find(call.op.operator_name()); it != by_name_.end()) {
      return decision(it->second, call.call_index);
    }
  }
  return Policy::PreferRecompute;
}

std::string SavedCallsPolicy::describe() const {
  if (!label_.empty()) {
    return label_;
  }
  return "save_calls(" + std::to_string(size_) + " calls" +
      (offloaded_ ? ", " + std::to_string(offloaded_) + " offloaded" : "") + ")";
}

std::shared_ptr<SavedCallsPolicy> save_calls(
    const std::vector<SavedCall>& calls,
    std::string label) {
  return std::make_shared<SavedCallsPolicy>(calls, std::move(label));
}

} // namespace torch_sac::policies
