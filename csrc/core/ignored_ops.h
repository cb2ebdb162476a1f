#pragma once
// Ops a policy never sees: metadata queries and detach, whose number differs
// between forward and recompute (PyTorch's SAC_IGNORED_OPS).

#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

namespace torch_sac {

bool is_ignored_op(const c10::OperatorName& name);

// A copy of the full set, for exposing to users.
std::vector<c10::OperatorName> ignored_op_names();

// Adds ops to the set (duplicates ignored) and forgets the cached op facts
// (op_facts.h), which hold the old answer. Called at import of the Python
// package with the installed torch's SAC_IGNORED_OPS. Lookups lock too, so a
// later call cannot race them; the lock is only taken when an op's facts are
// first computed, never per intercepted op. Lock order: the op-facts cache's
// lock, then this set's (add_ignored_ops releases its lock before it
// forgets the facts).
void add_ignored_ops(const std::vector<c10::OperatorName>& extra);

} // namespace torch_sac
