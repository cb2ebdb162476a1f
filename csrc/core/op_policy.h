#pragma once
// The interface every checkpointing policy implements, built-in or user-written.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>

#include "csrc/core/policy.h"

namespace torch_sac {

// One intercepted op after it ran: what a policy may look at.
struct OpCall {
  const c10::OperatorHandle& op;
  c10::ArrayRef<c10::IValue> inputs;
  c10::ArrayRef<c10::IValue> outputs;
  // How many times this op overload ran before in the same region (0-based).
  int64_t call_index;
  // Adapter-specific view of the same call (the Python objects the
  // Python-key adapter already holds), so a Python policy need not rebuild
  // them. nullptr when the call came through the dispatch-key adapter.
  const void* adapter_view = nullptr;
};

class OpPolicy {
 public:
  virtual ~OpPolicy() = default;
  // Called once per intercepted op in forward, never during recompute.
  virtual Policy decide(const OpCall& call) = 0;
  virtual std::string describe() const = 0;
  // False when decide() looks at nothing but the op and the call index: the
  // caller may then pass empty inputs and skip copying them.
  virtual bool needs_values() const {
    return true;
  }
  // Whether decide() reads OpCall::call_index. Callers that have no region
  // to count calls in (e.g. a policy_fn handed to PyTorch's own SAC, see
  // torch_sac/_torch_policy.py) must then count them per region themselves.
  virtual bool needs_call_index() const {
    return false;
  }
};

} // namespace torch_sac
