// SacContext: the region as a C++ RAII guard. The same steps as Python's
// sac_context (torch_sac/region.py): the outermost context on a thread makes
// the Region, routes the thread's ops to it through the key adapter and gives
// autograd its saved-tensor hooks; nested contexts stack their policy on it.

#include "torch_sac/sac_context.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <string>
#include <utility>

#include "csrc/api/autograd_hooks.h"
#include "csrc/core/interceptor.h"
#include "csrc/core/region/region.h"
#include "torch_sac/policies.h"

namespace torch_sac {

struct SacContext::State {
  std::shared_ptr<region::Region> region;
  bool owner = false;     // made the region (outermost on its thread)
  bool torn_down = false; // exited, possibly by an outer context's exit()
};

namespace {

// Contexts active on this thread, outermost first. Holds the states, not the
// contexts, so nothing here can dangle.
thread_local std::vector<std::shared_ptr<SacContext::State>> tls_contexts;

// Undoes what entering `state` installed; every step runs, the first error
// is kept in `error`.
void undo(SacContext::State& state, std::exception_ptr& error) {
  state.torn_down = true;
  auto step = [&](auto&& fn) {
    try {
      fn();
    } catch (...) {
      if (!error) {
        error = std::current_exception();
      }
    }
  };
  if (state.owner) {
    step([&] { pop_key_handler(state.region.get()); });
    step([&] { state.region->close(); });
  } else {
    step([&] { state.region->pop_policy(); });
  }
}

} // namespace

namespace api {

std::shared_ptr<region::Region> region_for_saved_tensors() {
  if (tls_contexts.empty()) {
    return nullptr;
  }
  return tls_contexts.front()->region;
}

} // namespace api

SacContext::SacContext(PolicyPtr policy, SacOptions options) {
  TORCH_CHECK_VALUE(policy, "torch_sac::SacContext: the policy is null");
  api::install_region_autograd_hooks();
  // The C++ API has only the key adapter: the Python-key adapter needs Python.
  install_key_adapter();

  auto state = std::make_shared<State>();
  if (!tls_contexts.empty()) {
    TORCH_CHECK_VALUE(
        options.replay_budget < 0,
        "torch_sac::SacContext: replay_budget is set on a context nested in another one; nested "
        "contexts record into the outermost region, whose budget applies: set it there.");
    state->region = tls_contexts.back()->region;
    state->region->push_policy(std::move(policy));
  } else {
    state->region = std::make_shared<region::Region>(
        std::move(policy), options.allow_cache_entry_mutation,
        options.replay_budget < 0 ? region::Region::kNoReplayBudget : options.replay_budget,
        options.replay_budget >= 0 && options.replay_budget_counts_saved,
        options.replay_checkpoint_share);
    state->owner = true;
    push_key_handler(state->region);
  }
  // Nothing can throw past this point: the context is entered.
  tls_contexts.push_back(state);
  state_ = std::move(state);
}

SacContext::SacContext(PolicyFn policy, SacOptions options)
    : SacContext(policies::from_callable(std::move(policy)), options) {}

SacContext::~SacContext() {
  if (!state_ || state_->torn_down) {
    return;
  }
  try {
    exit();
  } catch (const std::exception& e) {
    TORCH_WARN("torch_sac::SacContext: error while exiting a region: ", e.what());
  }
}

void SacContext::exit() {
  if (state_->torn_down) {
    return;
  }
  auto it = std::find(tls_contexts.begin(), tls_contexts.end(), state_);
  TORCH_CHECK(
      it != tls_contexts.end(),
      "torch_sac::SacContext: exited on a thread that did not enter it; regions are "
      "thread-local and must exit on the thread that entered them");
  const bool out_of_order = std::next(it) != tls_contexts.end();
  // Whatever the order, nothing this context (or any context entered after
  // it) installed stays installed.
  std::exception_ptr error;
  while (true) {
    std::shared_ptr<State> top = std::move(tls_contexts.back());
    tls_contexts.pop_back();
    undo(*top, error);
    if (top == state_) {
      break;
    }
  }
  TORCH_CHECK(
      !out_of_order,
      "torch_sac::SacContext: regions must exit in the reverse order they were entered; "
      "the regions entered after this one were exited with it");
  if (error) {
    std::rethrow_exception(error);
  }
}

bool SacContext::nested() const {
  return !state_->owner;
}

RegionHandle SacContext::handle() const {
  return RegionHandle(state_->region);
}

RegionHandle::RegionHandle(std::shared_ptr<region::Region> region) : region_(std::move(region)) {}

RegionStats RegionHandle::stats() const {
  TORCH_CHECK(region_, "torch_sac::RegionHandle::stats: the handle refers to no region");
  return region_->stats();
}

std::vector<RegionOpSummary> RegionHandle::op_details() const {
  TORCH_CHECK(region_, "torch_sac::RegionHandle::op_details: the handle refers to no region");
  return region_->op_summary();
}

bool in_sac_context() {
  return !tls_contexts.empty();
}

} // namespace torch_sac
