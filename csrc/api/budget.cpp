// The budget policy: a profile (op_profile.h) made into a set-union knapsack
// and solved (policies/budget_solver.h), as _plan in torch_sac/planners/budget_plan.py.

#include "torch_sac/budget.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

#include "csrc/api/op_profile.h"

namespace torch_sac {
namespace {

// 1536 -> "1.5 KiB", as torch_sac._op_profile.format_bytes.
std::string format_bytes(int64_t bytes) {
  double n = static_cast<double>(bytes);
  char buf[32];
  for (const char* unit : {"B", "KiB", "MiB"}) {
    if (std::abs(n) < 1024) {
      std::snprintf(buf, sizeof(buf), unit[0] == 'B' ? "%.0f %s" : "%.1f %s", n, unit);
      return buf;
    }
    n /= 1024;
  }
  std::snprintf(buf, sizeof(buf), "%.1f GiB", n);
  return buf;
}

std::string format_cost(double c, Cost cost) {
  char buf[32];
  if (cost == Cost::Flops) {
    const std::pair<const char*, double> scales[] = {
        {"TFLOP", 1e12}, {"GFLOP", 1e9}, {"MFLOP", 1e6}, {"kFLOP", 1e3}};
    for (const auto& [unit, scale] : scales) {
      if (std::abs(c) >= scale) {
        std::snprintf(buf, sizeof(buf), "%.1f %s", c / scale, unit);
        return buf;
      }
    }
    std::snprintf(buf, sizeof(buf), "%.0f FLOP", c); // counted, not measured: no fraction
    return buf;
  }
  const double magnitude = std::abs(c);
  const auto [unit, scale] = magnitude >= 1.0 ? std::pair("s", 1.0)
      : magnitude >= 1e-3                     ? std::pair("ms", 1e-3)
                                              : std::pair("us", 1e-6);
  std::snprintf(buf, sizeof(buf), "%.1f %s", c / scale, unit);
  return buf;
}

void check_options(const BudgetOptions& o, const char* where) {
  TORCH_CHECK_VALUE(
      o.bytes.has_value() != o.fraction.has_value(), where,
      ": pass exactly one of BudgetOptions::bytes and BudgetOptions::fraction (got ",
      o.bytes ? "both" : "neither",
      "), e.g. {.fraction = 0.5} for half the region's activation memory, or "
      "{.bytes = 64 << 20} for 64 MiB");
  if (o.bytes) {
    TORCH_CHECK_VALUE(
        *o.bytes >= 0, where,
        ": BudgetOptions::bytes must be >= 0 (0 saves only calls that keep "
        "no region memory), got ",
        *o.bytes);
  } else {
    TORCH_CHECK_VALUE(
        std::isfinite(*o.fraction) && *o.fraction >= 0, where,
        ": BudgetOptions::fraction must be finite and >= 0 (1.0: the region's whole "
        "un-checkpointed activation memory), got ",
        *o.fraction);
  }
  TORCH_CHECK_VALUE(
      o.repeats >= 0, where,
      ": BudgetOptions::repeats (replays per op when timing) must be "
      ">= 0, got ",
      o.repeats);
  TORCH_CHECK_VALUE(
      o.max_states > 0, where,
      ": BudgetOptions::max_states (the exact solver's work limit) "
      "must be > 0, got ",
      o.max_states);
  TORCH_CHECK_VALUE(
      o.cost == Cost::Time || o.cost == Cost::Flops, where,
      ": BudgetOptions::cost must be Cost::Time or Cost::Flops, got ", static_cast<int>(o.cost));
}

BudgetPlan make_plan(std::shared_ptr<const api::RegionProfile> profile, const BudgetOptions& o) {
  const api::RegionProfile& p = *profile;
  BudgetPlan plan;
  plan.cost = o.cost;
  plan.fraction = o.fraction;
  if (o.fraction) {
    const double bytes = *o.fraction * static_cast<double>(p.activation_bytes);
    // A fraction too large for int64 means no limit.
    plan.budget_bytes = bytes >= 0x1p63 ? std::numeric_limits<int64_t>::max()
                                        : static_cast<int64_t>(bytes);
  } else {
    plan.budget_bytes = *o.bytes;
  }
  auto cost_of = [&](const api::ProfiledCall& call) {
    return o.cost == Cost::Time ? call.seconds : call.flops;
  };

  // Items: the calls that can be saved. Storages from outside the region
  // cost nothing to keep.
  budget::Problem problem;
  problem.capacity = plan.budget_bytes;
  problem.storage_bytes.reserve(p.storages.size());
  for (const api::ProfiledStorage& s : p.storages) {
    problem.storage_bytes.push_back(s.internal ? s.nbytes : 0);
  }
  std::vector<size_t> candidates;
  for (size_t i = 0; i < p.calls.size(); ++i) {
    if (p.calls[i].saveable) {
      candidates.push_back(i);
      problem.items.push_back(budget::Item{cost_of(p.calls[i]), p.calls[i].storages});
    }
  }
  budget::Options solver_options;
  solver_options.method = o.solver;
  solver_options.max_states = o.max_states;
  const budget::Solution solution = budget::solve(problem, solver_options);

  plan.calls.reserve(p.calls.size());
  for (const api::ProfiledCall& call : p.calls) {
    plan.calls.push_back(
        PlannedCall{
            call.op.operator_name(), call.call_index, cost_of(call), p.call_bytes(call),
            p.new_bytes(call), call.saveable, call.why_not, /*saved=*/false});
    plan.total_cost += plan.calls.back().cost;
  }
  for (int64_t j : solution.chosen) {
    plan.calls[candidates[j]].saved = true;
  }
  for (const PlannedCall& call : plan.calls) {
    if (call.saved) {
      plan.chosen.push_back(policies::SavedCall{call.op, call.call_index});
    }
  }
  plan.saved_bytes = solution.bytes;
  plan.activation_bytes = p.activation_bytes;
  plan.total_bytes = p.total_bytes;
  plan.avoided_cost = solution.value;
  plan.solver = solution.method;
  plan.optimal = solution.optimal;
  plan.upper_bound = solution.upper_bound;
  plan.solver_note = solution.note;
  plan.solve_seconds = solution.seconds;
  plan.policy = policies::save_calls(
      plan.chosen,
      "budget(" + format_bytes(plan.budget_bytes) + ": saves " +
          std::to_string(plan.chosen.size()) + " of " + std::to_string(plan.calls.size()) +
          " op calls, " + format_bytes(plan.saved_bytes) + ", " +
          std::string(budget::method_name(plan.solver)) + ")");
  plan.profile = std::move(profile);
  return plan;
}

} // namespace

bool BudgetPlan::is_saved(const c10::OperatorName& op, int64_t call_index) const {
  for (const policies::SavedCall& call : chosen) {
    if (call.op == op && call.call_index == call_index) {
      return true;
    }
  }
  return false;
}

BudgetPlan BudgetPlan::with_budget(const BudgetOptions& options) const {
  const char* where = "torch_sac::BudgetPlan::with_budget";
  TORCH_CHECK_VALUE(
      profile, where,
      ": this plan has no profile (it was default-constructed); make plans with "
      "torch_sac::policies::budget");
  check_options(options, where);
  return make_plan(profile, options);
}

std::string BudgetPlan::summary() const {
  auto percent = [](double a, double b) {
    if (b == 0) {
      return std::string("-");
    }
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.0f%%", 100.0 * a / b);
    return std::string(buf);
  };
  std::string s = "budget " + format_bytes(budget_bytes);
  if (fraction) {
    s += " (" + percent(*fraction, 1.0) + " of activations)";
  }
  s += "; saves " + std::to_string(chosen.size()) + "/" + std::to_string(calls.size()) +
      " op calls keeping " + format_bytes(saved_bytes) + " (un-checkpointed activations " +
      format_bytes(activation_bytes) + ", everything " + format_bytes(total_bytes) + "); avoids " +
      format_cost(avoided_cost, cost) + " of " + format_cost(total_cost, cost) + " recompute (" +
      percent(avoided_cost, total_cost) + "); solver " + std::string(budget::method_name(solver));
  s += optimal ? ", optimal"
               : ", within " + format_cost(upper_bound - avoided_cost, cost) + " of optimal";
  if (!solver_note.empty()) {
    s += " (" + solver_note + ")";
  }
  return s;
}

namespace policies {

BudgetPlan budget(const std::function<void()>& fn, const BudgetOptions& options) {
  const char* where = "torch_sac::policies::budget";
  TORCH_CHECK_VALUE(
      fn, where, ": fn is empty; pass the region, e.g. [&] { return block->forward(x); }");
  check_options(options, where);
  auto profile = std::make_shared<const api::RegionProfile>(
      api::profile_region(fn, options.cost == Cost::Time ? options.repeats : 0));
  return make_plan(std::move(profile), options);
}

} // namespace policies
} // namespace torch_sac
