#pragma once
// Selective activation checkpointing for C++ (LibTorch) code: a region.
//
//   torch_sac::SacContext region(torch_sac::policies::save_matmuls());
//   auto y = block->forward(x);   // every op is recorded below autograd
//   ...
//   loss.backward();              // dropped activations are replayed in C++
//
// While a SacContext is alive on a thread, every ATen op that thread runs is
// seen by torch_sac's interceptor and passed to the policy; outputs the
// policy drops are not held for backward but rebuilt from the recorded ops
// when backward needs them. The same engine as Python's
// `torch_sac.sac_context` (csrc/core/region/), with the same guarantees:
// gradients equal those without checkpointing, random ops replay the same
// values, an op that wrote to a tensor from outside the region is not
// applied to it again, backward may run on any thread.
//
// Regions are thread-local and nest: a SacContext entered while another is
// active on the thread stacks its policy on the outer region (MUST beats
// PREFER, the innermost PREFER wins, two different MUSTs raise). With grad
// disabled or in inference mode nothing is recorded.
//
// C++ only: in a Python process use torch_sac.sac_context (the constructor
// raises there; see csrc/api/autograd_hooks.h).

#include <c10/macros/Macros.h>

#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "csrc/core/op_policy.h"
#include "csrc/core/stats.h"

// The engine behind a SacContext (csrc/core/region/region.h): not part of the
// API, so its header is not included here.
namespace torch_sac::region {
class Region;
} // namespace torch_sac::region

namespace torch_sac {

// Counters of one region and its per-op breakdown (csrc/core/stats.h: each
// counter with what it counts).
using RegionStats = region::RegionStats;
using RegionOpSummary = region::RegionOpSummary;

// A policy object: a built-in from torch_sac/policies.h or your own OpPolicy.
using PolicyPtr = std::shared_ptr<OpPolicy>;
// A policy written as a C++ callable: called once per op in forward, after
// the op ran (OpCall holds its inputs and outputs), never during replay.
using PolicyFn = std::function<Policy(const OpCall&)>;

struct SacOptions {
  // A kept output that a replay needs, modified in place after use, raises
  // on replay by default; true lets the replay use the modified value.
  bool allow_cache_entry_mutation = false;
  // At most this many bytes of rebuilt tensors held during backward; ones
  // that do not fit are rebuilt again when needed (multiple recomputation).
  // Negative: no budget. See docs/design.md, "Replay budget".
  int64_t replay_budget = -1;
  // The budget also counts outputs the policy kept in forward that are still
  // alive (a plan whose forward keeps checkpoints the budget then reuses).
  bool replay_budget_counts_saved = false;
  // Of what is free under the budget, the most the spaced heuristic gives to
  // checkpoints (the rest to the tensors backward needs next), in (0, 1].
  double replay_checkpoint_share = 0.5;
};

// What a region recorded, readable after the SacContext that recorded it is
// gone (e.g. after backward). Copyable; keeps the region's statistics alive,
// not its tensors.
class RegionHandle {
 public:
  RegionHandle() = default;
  bool defined() const {
    return region_ != nullptr;
  }
  // Saved/dropped ops and bytes, replayed ops and replay time, ...
  RegionStats stats() const;
  // Per op overload, in first-seen order.
  std::vector<RegionOpSummary> op_details() const;

 private:
  friend class SacContext;
  // Region is incomplete here: the shared_ptr is made (and its deleter
  // captured) in sac_context.cpp, where Region is complete; this constructor
  // is out of line for the same reason.
  explicit RegionHandle(std::shared_ptr<region::Region> region);
  std::shared_ptr<region::Region> region_;
};

// RAII: checkpoints the ops run on this thread from construction to exit()
// or destruction.
class SacContext {
 public:
  explicit SacContext(PolicyPtr policy, SacOptions options = {});
  explicit SacContext(PolicyFn policy, SacOptions options = {});
  // Exits if exit() was not called. Never throws: a misuse (destroyed on
  // another thread than the one that entered it) is reported as a warning.
  ~SacContext();

  SacContext(const SacContext&) = delete;
  SacContext& operator=(const SacContext&) = delete;
  SacContext(SacContext&&) = delete;
  SacContext& operator=(SacContext&&) = delete;

  // Stops recording. Contexts exit in reverse order of entry; exiting one
  // while a context entered after it is still active exits that one too,
  // then raises. Idempotent.
  void exit();

  // True when this context stacked its policy on an outer one's region.
  bool nested() const;
  // The region this context records into (the outermost one's when nested).
  RegionHandle handle() const;
  RegionStats stats() const {
    return handle().stats();
  }
  std::vector<RegionOpSummary> op_details() const {
    return handle().op_details();
  }

  // Entry state shared with the thread's context stack, so that a context
  // exited with an outer one is known as such (never dereferenced by other
  // threads).
  struct State;

 private:
  std::shared_ptr<State> state_;
};

// True while a SacContext is active on this thread.
bool in_sac_context();

// Runs `fn(inputs)` inside a SacContext with `policy` (a PolicyPtr or a
// PolicyFn) and returns its result. Backward never calls `fn` again:
// dropped activations are rebuilt by replaying the recorded ops.
//
//   auto y = torch_sac::checkpoint(
//       [&](const at::Tensor& x) { return block->forward(x); }, x,
//       torch_sac::policies::recompute_all());
template <typename Fn, typename Inputs, typename PolicyT>
std::invoke_result_t<Fn, Inputs> checkpoint(
    Fn&& fn,
    Inputs&& inputs,
    PolicyT&& policy,
    SacOptions options = {}) {
  SacContext region(std::forward<PolicyT>(policy), options);
  return std::invoke(std::forward<Fn>(fn), std::forward<Inputs>(inputs));
}

} // namespace torch_sac
