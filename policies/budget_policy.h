#pragma once
// A policy that saves an explicit set of op calls, keyed like the selective
// checkpoint contexts key their cache: (op overload, call index within the
// region). The budget planner (torch_sac.policies.budget) produces one; it is
// decided in C++ and never calls Python.

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "csrc/core/op_policy.h"

namespace torch_sac::policies {

struct SavedCall {
  c10::OperatorName op; // {"aten::mm", ""} for aten.mm.default
  int64_t call_index;   // 0-based, per op overload, within one region
  // Kept in host memory instead (PREFER_OFFLOAD: saved where it cannot be
  // offloaded), as a peak plan with offload options chooses.
  bool offload = false;
};

// MUST_SAVE (or PREFER_OFFLOAD) for exactly the listed calls,
// PREFER_RECOMPUTE for every other call (including ops the plan never saw).
class SavedCallsPolicy : public OpPolicy {
 public:
  SavedCallsPolicy(const std::vector<SavedCall>& calls, std::string label);
  Policy decide(const OpCall& call) override;
  std::string describe() const override;
  // Listed calls, and of them those offloaded.
  int64_t size() const {
    return size_;
  }
  int64_t offloaded() const {
    return offloaded_;
  }

 private:
  // Per call index of one op: not listed, saved, offloaded.
  enum Listed : uint8_t { kNo = 0, kSave, kOffload };
  static Policy decision(const std::vector<uint8_t>& indices, int64_t call_index) {
    const uint8_t listed = call_index >= 0 && static_cast<size_t>(call_index) < indices.size()
        ? indices[call_index]
        : kNo;
    return listed == kSave   ? Policy::MustSave
        : listed == kOffload ? Policy::PreferOffload
                             : Policy::PreferRecompute;
  }
  // Ops resolved to handles when the policy is built (hash by pointer, no
  // string hashing per call); names not registered yet are looked up by name.
  std::unordered_map<c10::OperatorHandle, std::vector<uint8_t>> by_handle_;
  std::unordered_map<c10::OperatorName, std::vector<uint8_t>> by_name_;
  std::string label_;
  int64_t size_ = 0;
  int64_t offloaded_ = 0;
};

std::shared_ptr<SavedCallsPolicy> save_calls(
    const std::vector<SavedCall>& calls,
    std::string label = "");

} // namespace torch_sac::policies
