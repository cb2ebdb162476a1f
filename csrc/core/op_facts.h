#pragma once
// What an op overload's schema and tags say, for both engines: the drop-in
// (selective_cache.h) and the region engine (region/region.h) read the same
// OpFacts, computed once per process by the same rules, so they cannot
// disagree on what an op writes, returns or draws.
//
// A new fact about ops goes here (CONTRIBUTING.md, "Adding a fact about
// ops"); the helpers it is computed from stay where they are
// (ignored_ops.h, written_args.h).

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace torch_sac {

struct OpFacts {
  std::string name;     // op_display_name: "aten::mm.default"
  bool ignored = false; // is_ignored_op: no policy sees it, neither engine records it
  // written_args(): the (a!) arguments plus batch norm's running statistics.
  std::vector<size_t> written_args;
  bool returns_written_arg = false; // some return aliases a written argument (in-place, out=)
  bool returns_alias = false;       // some return aliases an argument (views, in-place, out=)
  bool makes_new_tensors = false;   // some Tensor or Tensor[] return aliases nothing
  // ATen's nondeterministic_seeded tag: the op may draw random numbers;
  // whether a given call does is call_draws_random().
  bool draws_random = false;
  std::optional<size_t> dropout_p_arg; // a `dropout_p` argument (SDPA kernels)
  // Collectives (c10d::, _c10d_functional::, _c10d_functional_autograd::,
  // _dtensor::).
  bool collective = false;
  // A collective a region may replay, waiting for it at once: a functional
  // one (_c10d_functional::, out of place, not wait_tensor), or a c10d one
  // filling a buffer (`filled_buffer`: that argument, written whole). The
  // others write tensors they also read (c10d::allreduce_), or carry
  // autograd of their own, and run as if outside a region.
  bool replayable_collective = false;
  std::optional<size_t> filled_buffer;
  // _c10d_functional::wait_tensor: waits for a functional collective's
  // output and returns it. The drop-in neither numbers nor caches it: an
  // AsyncCollectiveTensor waits lazily, once per Python object, so a
  // checkpointed function's input waited in forward is not waited again in
  // recompute, and the per-op call indices of the waits would shift.
  bool collective_wait = false;
  size_t num_args = 0;
  size_t num_returns = 0;
};

// The facts about `op`, from a process-wide cache: one hash lookup under a
// mutex, and reading the schema only the first time. An op's facts are
// dropped when it is deregistered (a new op may get its handle) and when
// the ignored set grows (add_ignored_ops); a holder keeps its copy alive.
std::shared_ptr<const OpFacts> op_facts(const c10::OperatorHandle& op);

// The facts computed afresh, without the cache.
OpFacts compute_op_facts(const c10::OperatorHandle& op);

// Whether this call of an op with `facts` draws random numbers: the op is
// seeded and is not called with `dropout_p` == 0 (an attention kernel
// without dropout draws nothing). `args` are the call's arguments, in
// schema order. The drop-in caches such calls only when this is false; the
// region records an RNG snapshot only when it is true.
inline bool call_draws_random(const OpFacts& facts, c10::ArrayRef<c10::IValue> args) {
  if (!facts.draws_random) {
    return false;
  }
  if (facts.dropout_p_arg && *facts.dropout_p_arg < args.size()) {
    const c10::IValue& p = args[*facts.dropout_p_arg];
    return !(p.isDouble() && p.toDouble() == 0.0);
  }
  return true;
}

// Empties the cache (add_ignored_ops calls it).
void forget_op_facts();

} // namespace torch_sac
