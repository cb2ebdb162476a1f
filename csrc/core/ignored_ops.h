#pragma once
// Ops a policy never sees: metadata queries and detach, whose number differs
// between forward and recompute (PyTorch's SAC_IGNORED_OPS).

#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

namespace torch_sac {

bool is_ignored_op(const c10::OperatorName& name);

// The full set, "ns::name.overload" ("" overload printed as "default"), for
// exposing to users.
const std::vector<c10::OperatorName>& ignored_op_names();

} // namespace torch_sac
