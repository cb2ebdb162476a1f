#pragma once
// The memory-budget policy for C++ code: profile one forward of a region,
// then save the op calls that avoid the most recompute within a memory
// budget (Python: torch_sac.policies.budget).
//
//   auto plan = torch_sac::policies::budget(
//       [&] { return block->forward(x); }, {.fraction = 0.5});
//   std::cout << plan.summary() << "\n";
//   for (auto& block : blocks) {           // same shapes: one plan for all
//     torch_sac::SacContext region(plan.policy);
//     x = block->forward(x);
//   }
//
// Profiling runs `fn` once with grad enabled and records every op call a
// region's policy would see, keyed as the region keys them: (op overload,
// call index within the region), ops in ignored_ops.h not counted. Each
// call's recompute cost is measured (Cost::Time) or counted (Cost::Flops),
// and its memory is the size of the storages its outputs keep alive: a view
// or an in-place op's output shares its input's storage, so a storage counts
// once however many saved outputs keep it; storages from outside the region
// (parameters, inputs) cost nothing; an op whose output is mutated in place
// later in the region is never saved. The set-union knapsack is solved in
// C++ (policies/budget_solver.h). The plan's policy answers MustSave for the
// chosen calls and PreferRecompute for every other call.
//
// `fn` really runs once: side effects other than on random numbers happen
// (BatchNorm running statistics); the CPU and CUDA generators are restored
// afterwards. The plan is for the shapes and control flow of that run; calls
// it did not see are recomputed. Timings of tiny ops are dominated by
// dispatch overhead: profile with realistic sizes.

#include <ATen/core/operator_name.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "policies/budget_policy.h"
#include "policies/budget_solver.h"
#include "torch_sac/sac_context.h"

namespace torch_sac {

namespace api {
struct RegionProfile;
} // namespace api

// What saving an op call avoids recomputing.
enum class Cost : uint8_t {
  // Measured: the median of the call and `repeats` replays of it (an op that
  // mutates a tensor or draws random numbers is timed once), in seconds.
  Time,
  // Counted, as torch.utils.flop_counter counts them: mm, addmm, bmm,
  // baddbmm, _scaled_mm and convolutions. Other ops (pointwise, CPU
  // attention) are worth 0 and never saved.
  Flops,
};

struct BudgetOptions {
  // The budget, exactly one of: at most `bytes` bytes of saved outputs, or
  // `fraction` of the region's un-checkpointed activation memory
  // (BudgetPlan::activation_bytes). Both must be >= 0.
  std::optional<int64_t> bytes;
  std::optional<double> fraction;
  Cost cost = Cost::Time;
  // Replays per op when timing (Cost::Time), >= 0.
  int repeats = 3;
  // Auto: exact, falling back to greedy for very large regions; Exact:
  // optimal for the cost model, or raise; Greedy: see budget_solver.h.
  budget::Method solver = budget::Method::Auto;
  // Work limit of the exact solver (DP states), > 0.
  int64_t max_states = budget::Options{}.max_states;
};

// One op call of the profiled region and what the plan does with it.
struct PlannedCall {
  c10::OperatorName op;   // {"aten::mm", ""} for aten.mm.default
  int64_t call_index = 0; // per op overload, within the region
  double cost = 0;        // recompute cost: seconds or FLOPs
  int64_t bytes = 0;      // of the region storages its outputs keep
  int64_t new_bytes = 0;  // of which it allocated itself (0: view, in-place)
  bool saveable = true;
  std::string why_not; // when not saveable: "in-place op", ...
  bool saved = false;  // MustSave in the plan
};

struct BudgetPlan {
  // MustSave for `chosen`, PreferRecompute for everything else: pass it to
  // SacContext or checkpoint().
  PolicyPtr policy;
  std::vector<policies::SavedCall> chosen; // in region order
  std::vector<PlannedCall> calls;          // every op call, in region order

  Cost cost = Cost::Time;
  int64_t budget_bytes = 0;
  std::optional<double> fraction; // when the budget was given as one
  // Bytes of the distinct region storages the saved outputs keep alive
  // (<= budget_bytes).
  int64_t saved_bytes = 0;
  // The region's un-checkpointed activation memory: the distinct region
  // storages autograd saved for backward in the profiling forward (seen
  // through the autograd engine's saved-variable hooks).
  int64_t activation_bytes = 0;
  // What saving every op call would keep.
  int64_t total_bytes = 0;
  // Recompute cost the plan avoids, and that of all calls (seconds or FLOPs).
  double avoided_cost = 0;
  double total_cost = 0;

  budget::Method solver = budget::Method::Exact; // Exact or Greedy: what ran
  bool optimal = false;                          // proven optimal for the cost model
  double upper_bound = 0;                        // proven bound on the best avoidable cost
  std::string solver_note;                       // why Auto fell back to greedy, if it did
  double solve_seconds = 0;

  // Whether the plan saves call `call_index` of `op`.
  bool is_saved(const c10::OperatorName& op, int64_t call_index) const;
  // The plan for another budget, cost or solver from the same profile: `fn`
  // does not run again and `repeats` is not used (Cost::Time uses the
  // profile's timings, single runs if it was made for Cost::Flops).
  BudgetPlan with_budget(const BudgetOptions& options) const;
  // The plan in one line: budget, saved calls and bytes, cost avoided,
  // solver.
  std::string summary() const;

  // What the plan was made from (opaque; shared by with_budget's plans).
  std::shared_ptr<const api::RegionProfile> profile;
};

namespace policies {

// Profiles one run of `fn` (a lambda returning the region's output, or
// nothing) and plans for `options`. Raises c10::ValueError for bad options
// and when called inside a SacContext; an exception from `fn` propagates,
// with nothing left installed.
BudgetPlan budget(const std::function<void()>& fn, const BudgetOptions& options);

} // namespace policies

} // namespace torch_sac
