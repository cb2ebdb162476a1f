#pragma once
// Policies written in Python, and the conversions between Python policy
// values and torch_sac::Policy.

#include <pybind11/pybind11.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "csrc/core/op_policy.h"

namespace torch_sac::python {

// Records torch_sac.Policy and torch.utils.checkpoint.CheckpointPolicy so
// returned values are recognised by identity.
void register_policy_enums(pybind11::object sac_policy, pybind11::object torch_policy);

// Wraps `fn(ctx, op, *args, **kwargs)` with torch's policy_fn signature.
std::shared_ptr<OpPolicy> make_python_policy(pybind11::object fn);

// (qualified name, overload or None for a whole packet) pairs from Python.
using OpPatternList = std::vector<std::pair<std::string, std::optional<std::string>>>;
std::shared_ptr<OpPolicy> make_save_ops(const OpPatternList& ops);
std::shared_ptr<OpPolicy> make_offload_ops(const OpPatternList& ops);
std::shared_ptr<OpPolicy> make_every_nth(const OpPatternList& ops, int64_t n);

// The Python Policy member for a C++ decision.
pybind11::object policy_to_python(Policy p);

} // namespace torch_sac::python
