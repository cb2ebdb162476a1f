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

// Adds ops to the set (duplicates ignored). Called once, at import of the
// Python package, with the installed torch's SAC_IGNORED_OPS, before any
// region or context exists: lookups take no lock.
void add_ignored_ops(const std::vector<c10::OperatorName>& extra);

} // namespace torch_sac
