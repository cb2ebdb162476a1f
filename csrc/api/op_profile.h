#pragma once
// Profiling one forward of a region for the budget planner, in C++ (the
// counterpart of torch_sac/_op_profile.py): every op call a region's policy
// would see, keyed as the region keys it, with its recompute cost and the
// storages its outputs keep alive.

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace torch_sac::api {

// A storage seen during the profiled forward.
struct ProfiledStorage {
  int64_t nbytes = 0;
  // Created inside the region (by an op's output). Storages from outside
  // (parameters, buffers, the region's inputs) are alive anyway: keeping
  // them costs the region nothing.
  bool internal = false;
  // Saved for backward by autograd in the (un-checkpointed) profiling forward.
  bool saved_by_autograd = false;
};

// One op call a policy would decide on.
struct ProfiledCall {
  explicit ProfiledCall(c10::OperatorHandle op) : op(std::move(op)) {}
  c10::OperatorHandle op;
  int64_t call_index = 0; // per op overload, as the region counts
  double seconds = 0;     // median over the call and its replays
  double flops = 0;       // 0 for ops torch.utils.flop_counter does not count
  // Indices into RegionProfile::storages held by the outputs (distinct), and
  // those of them this call allocated.
  std::vector<int64_t> storages;
  std::vector<int64_t> new_storages;
  // False when saving it would hand back stale data: an output is mutated
  // in place later in the region.
  bool saveable = true;
  std::string why_not;
};

struct RegionProfile {
  std::vector<ProfiledCall> calls;
  std::vector<ProfiledStorage> storages;
  // Bytes of the distinct region storages autograd saved for backward: the
  // region's activation memory without checkpointing.
  int64_t activation_bytes = 0;
  // Bytes of the distinct region storages the calls' outputs hold: what
  // saving every call would keep.
  int64_t total_bytes = 0;

  // Bytes of the region storages `call`'s outputs keep alive.
  int64_t call_bytes(const ProfiledCall& call) const;
  // Of which `call` allocated.
  int64_t new_bytes(const ProfiledCall& call) const;
};

// Runs `fn` once with grad enabled, its ops routed through a profiling
// handler on the key adapter (as a SacContext routes them to its region) and
// the tensors autograd saves observed through the engine's saved-variable
// hooks. Each op call is timed with steady_clock; with `repeats` > 0 an op
// that neither mutates nor draws random numbers is run `repeats` more times
// and the median taken. The CPU and CUDA generators' states are restored
// afterwards. Raises when a SacContext is active on this thread; an
// exception from `fn` propagates with nothing left installed.
RegionProfile profile_region(const std::function<void()>& fn, int repeats);

} // namespace torch_sac::api
