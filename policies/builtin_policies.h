#pragma once
// The built-in policy library: policies decided in C++, never calling Python.

#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "csrc/core/op_policy.h"

namespace torch_sac::policies {

// An op or a whole op packet: `overload` unset matches every overload of
// `name` ("aten::mm"), as an OpOverloadPacket does in Python.
struct OpPattern {
  std::string name;
  std::optional<std::string> overload; // "" is the default overload
};

// Matches op names against a list of patterns.
class OpMatcher {
 public:
  explicit OpMatcher(const std::vector<OpPattern>& patterns);
  bool matches(const c10::OperatorName& op) const;
  std::string describe() const;

 private:
  std::unordered_set<std::string> packets_;
  std::unordered_set<c10::OperatorName> overloads_;
};

// MUST_SAVE for the listed ops, PREFER_RECOMPUTE for the rest (torch's
// semantics for a list of ops).
std::shared_ptr<OpPolicy> save_ops(const std::vector<OpPattern>& ops);

// PREFER_OFFLOAD for the listed ops (their outputs go to host memory; ones
// that cannot, such as CPU tensors or ones below the size threshold, are
// saved), PREFER_RECOMPUTE for the rest.
std::shared_ptr<OpPolicy> offload_ops(const std::vector<OpPattern>& ops);

// PREFER_SAVE for every op: no memory saved, no recompute.
std::shared_ptr<OpPolicy> save_all();

// PREFER_RECOMPUTE for every op: plain activation checkpointing.
std::shared_ptr<OpPolicy> recompute_all();

// save_ops over matrix multiplies, convolutions and attention kernels, the
// expensive ops whose outputs are worth their memory (torchtitan's choice).
std::shared_ptr<OpPolicy> save_matmuls();
const std::vector<OpPattern>& matmul_ops();
// offload_ops over the same ops.
std::shared_ptr<OpPolicy> offload_matmuls();

// MUST_SAVE for call indices 0, n, 2n, ... of each listed op overload within
// a region, PREFER_RECOMPUTE otherwise. The index comes from the region, so
// the policy holds no counter and recompute cannot shift it.
std::shared_ptr<OpPolicy> every_nth(const std::vector<OpPattern>& ops, int64_t n);

// MUST_SAVE for ops that run while at least one of the named scopes is open
// on the dispatching thread (csrc/core/name_scope.h; any enclosing scope
// counts, not only the innermost), PREFER_RECOMPUTE for the rest. JAX's
// save_only_these_names, with names on regions of code. Reads the
// thread-local scope stack: a few integer compares per op, no Python.
// Inside a listed scope, random ops (tag nondeterministic_seeded), ops that
// write to an argument (in-place, out=) and uninitialized allocations
// (aten::empty*) are still recomputed: caching a random op while a later one
// is recomputed would shift the RNG stream of the recompute, and the others'
// cached outputs would always be mutated after caching (see the .cpp).
std::shared_ptr<OpPolicy> save_by_name(const std::vector<std::string>& names);

} // namespace torch_sac::policies
