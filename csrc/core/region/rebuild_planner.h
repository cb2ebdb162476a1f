#pragma once
// Planning a rebuild, and what it keeps.
//
// A rebuild replays, in tape order, exactly the entries a storage depends on
// that no memo covers (plan()); it runs them (Region::materialize) and keeps
// the storages it rebuilds on the way that autograd will unpack later in
// this backward pass ("candidates"), as many as allowed: all of them, those
// a replay schedule names, or those a replay budget chooses
// (replay_budget.h); nested regions keep only their own
// (memos_allowed()). After the rebuild, a schedule or a budget may let go
// of other rebuilt tensors (release_after_rebuild()). The rebuilds of the
// current pass and what each kept are recorded (executed_schedule()).
//
// Part of Region (region.h), which owns it and guards it with its mutex.

#include <c10/core/Storage.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "csrc/core/region/ids.h"
#include "csrc/core/region/replay_budget.h"
#include "csrc/core/region/replay_schedule.h"
#include "csrc/core/region/storage_table.h"
#include "csrc/core/region/tape.h"
#include "csrc/core/stats.h"

namespace torch_sac::region {

// No replay budget: every rebuilt tensor autograd will unpack later in this
// backward is kept until then.
inline constexpr int64_t kNoReplayBudget = -1;

// The entries one rebuild replays, and what it starts from.
struct ReplayPlan {
  std::vector<EntryId> entries;                  // in tape order
  std::unordered_map<StorageId, StateId> states; // storage -> state to rebuild
  // Storages a memo covers (pinned for the replay), with their state.
  std::unordered_map<StorageId, std::pair<c10::Storage, StateId>> memos;
};

class RebuildPlanner {
 public:
  // `replay_budget`, `budget_counts_saved`, `checkpoint_share`: see Region.
  RebuildPlanner(
      const Tape& tape,
      StorageTable& storages,
      RegionStats& stats,
      int64_t replay_budget,
      bool budget_counts_saved,
      double checkpoint_share)
      : tape_(tape),
        storages_(storages),
        stats_(stats),
        replay_budget_(replay_budget),
        budget_counts_saved_(budget_counts_saved),
        checkpoint_share_(checkpoint_share) {}

  // What rebuilding `storage` at `state` replays: a worklist walk back from
  // it collecting producers and writes up to the needed state of every
  // storage no memo covers.
  ReplayPlan plan(StorageId storage, StateId state) const;
  // Which candidates this rebuild may keep: the schedule's step, the replay
  // budget's choice (replay_budget.h), or all of them (nullopt). `scope`: of
  // the saved activation the rebuild is for. Counts the rebuild and records
  // it among the executed ones.
  std::optional<std::unordered_set<StorageId>> memos_allowed(
      const ReplayPlan& plan,
      StorageId target,
      ScopeId scope);
  // After a rebuild: the schedule's releases, or under a replay budget, lets
  // go of other rebuilt tensors until what the region holds fits (the one
  // just rebuilt for autograd stays held). Records what it released.
  void release_after_rebuild(StorageId target);
  // What the replay budget bounds: rebuilt tensors held, plus (when it
  // counts them) live outputs the policy kept.
  int64_t budgeted_bytes() const;
  bool budget_counts_saved() const {
    return budget_counts_saved_;
  }
  // Rebuilds so far in this backward pass.
  size_t rebuilds() const {
    return executed_.size();
  }

  // Runs `schedule` in backward instead of choosing (not with a budget).
  void set_schedule(ReplaySchedule schedule);
  // The rebuilds of the current (or last) backward pass and what each kept.
  ReplaySchedule executed_schedule() const;
  // Backward runs again: a new list of rebuilds.
  void start_new_pass() {
    executed_.clear();
  }

 private:
  // A rebuilt tensor's key by index into Tape::ops (op names are made when
  // asked for: a big model rebuilds thousands of tensors).
  struct ExecutedKey {
    int32_t op_index;
    int64_t call_index;
    int32_t output;
  };
  struct ExecutedStep {
    ExecutedKey unpacked;
    std::vector<ExecutedKey> keep;
    std::vector<ExecutedKey> release;
  };
  // Storages by the key a schedule names them with (op name, call index,
  // output): a recorded schedule of a large model names thousands per step.
  class StoragesByKey {
   public:
    StoragesByKey(const RebuildPlanner& planner, const std::vector<StorageId>& storages);
    StorageId find(const TensorKey& key) const; // invalid: not among them

   private:
    std::map<std::tuple<int32_t, int64_t, int32_t>, StorageId> by_key_;
    std::unordered_map<std::string, int32_t> op_index_;
  };

  // The storages `plan` rebuilds that autograd will unpack later, other
  // than `target`, in the order the plan makes them.
  std::vector<StorageId> memo_candidates(const ReplayPlan& plan, StorageId target) const;
  // Nested regions drop their own tensors again, as nested checkpoints do:
  // a rebuild for a tensor saved in scope T keeps a candidate only if it was
  // made or read in T or a scope enclosing T. The others (a nested region's
  // internals met on the way) are rebuilt when that region's backward
  // unpacks them: multiple recomputation of the inner ops.
  bool nesting_allows(StorageId candidate, ScopeId scope) const;
  std::unordered_set<StorageId> memos_within_budget(
      const ReplayPlan& plan,
      StorageId target,
      const std::vector<StorageId>& candidates);
  std::unordered_set<StorageId> memos_scheduled(
      StorageId target,
      const std::vector<StorageId>& candidates,
      size_t rebuild) const;
  ExecutedKey executed_key_of(StorageId storage) const;
  TensorKey key_of(StorageId storage) const;
  std::string describe_key(const TensorKey& key) const;

  const Tape& tape_;
  StorageTable& storages_;
  RegionStats& stats_;
  const int64_t replay_budget_;
  const bool budget_counts_saved_;
  const double checkpoint_share_;
  std::optional<ReplaySchedule> schedule_;
  std::vector<ExecutedStep> executed_; // this backward pass's rebuilds
};

} // namespace torch_sac::region
