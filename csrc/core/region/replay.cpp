// Rebuilding dropped activations by replaying the region's tape.

#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <sstream>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "csrc/core/detached_alias.h"
#include "csrc/core/ivalue_tensors.h"
#include "csrc/core/region/region.h"
#include "csrc/core/region/replay_budget.h"
#include "csrc/core/replay_guard.h"
#include "csrc/core/tensor_version.h"

namespace torch_sac::region {
namespace {

std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << "[" << t.toString() << " " << t.sizes() << "]";
  return out.str();
}

} // namespace

at::Tensor unpack(const SavedActivation& saved) {
  if (saved.region) {
    return saved.region->rebuild(saved);
  }
  if (saved.kept.defined()) {
    const uint32_t now = current_version(saved.version_counter);
    TORCH_CHECK(
        now == saved.version,
        "one of the variables needed for gradient computation has been "
        "modified by an inplace operation: ",
        describe(saved.kept), " is at version ", now, "; expected version ", saved.version,
        " instead. (torch_sac: the tensor was saved for backward inside a "
        "sac_context region.) Hint: enable anomaly detection with "
        "torch.autograd.set_detect_anomaly(True) to find the operation that "
        "failed to compute its gradient.");
  }
  return saved.kept;
}

at::Tensor Region::rebuild(const SavedActivation& saved) {
  // The views and aliases made here are the region's own bookkeeping: a
  // region open on this thread (backward inside the `with` block) must not
  // record them, and this one would deadlock on its own mutex.
  const c10::impl::ExcludeDispatchKeyGuard not_intercepted(kInterceptKey);
  std::lock_guard<std::mutex> lock(mutex_);
  StorageRecord& record = storages_.at(saved.storage);
  const uint32_t now = current_version(saved.version_counter);
  TORCH_CHECK(
      now == saved.version,
      "one of the variables needed for gradient computation has been modified "
      "by an inplace operation: a tensor of shape ",
      c10::IntArrayRef(saved.geometry.sizes), " is at version ", now, "; expected version ",
      saved.version,
      " instead. (torch_sac: it was saved for backward inside a sac_context "
      "region and dropped by the policy.) Hint: enable anomaly detection with "
      "torch.autograd.set_detect_anomaly(True) to find the operation that "
      "failed to compute its gradient.");
  const int task = torch::autograd::get_current_graph_task_id();
  const bool same_backward = task >= 0 && task == saved.unpacked_task;
  if (saved.unpacked_pass == pass_ && !same_backward) {
    start_new_pass(); // backward runs again (retain_graph=True)
  }
  if (saved.unpacked_pass != pass_) {
    saved.unpacked_pass = pass_;
    --record.pending_unpacks;
  }
  saved.unpacked_task = task;
  if (saved.original) {
    auto original = saved.original->lock();
    if (original.defined()) {
      ++stats_.unpacked_original;
      return held_for_backward(at::Tensor(std::move(original)));
    }
  }
  // The storage itself may still be alive (another region, or the user,
  // kept a different tensor of it) and unchanged since it was saved.
  if (c10::Storage alive(record.identity.lock());
      alive && record.mutations.next_id() == saved.state && saved.geometry.fits(alive)) {
    ++stats_.unpacked_original;
    return saved.geometry.view_of(alive);
  }
  restored_in_replay_ = false;
  c10::Storage base;
  try {
    base = materialize(saved.storage, saved.state, saved.scope);
  } catch (...) {
    if (restored_in_replay_ && restorer_.done) {
      restorer_.done();
    }
    throw;
  }
  if (restored_in_replay_ && restorer_.done) {
    restorer_.done();
  }
  at::Tensor result = saved.geometry.view_of(base);
  result.unsafeGetTensorImpl()->set_version_counter(record.memo.version());
  release_memos();
  return result;
}

void Region::start_new_pass() {
  ++pass_;
  executed_.clear();
  for (StorageRecord& record : storages_) {
    record.pending_unpacks = record.live_refs;
  }
  for (StorageId s : memoised_) {
    storages_[s].memo.clear();
  }
  memoised_.clear();
}

Region::ReplayPlan Region::plan_rebuild(StorageId storage, StateId state) const {
  ReplayPlan plan;
  std::unordered_set<EntryId> planned;
  struct Need {
    StorageId storage;
    StateId state;
    bool written; // the entry writes to it: never hand it a memo
  };
  std::vector<Need> needed{{storage, state, false}};
  auto add_entry = [&](EntryId e) {
    if (planned.insert(e).second) {
      plan.entries.push_back(e);
      const Entry& entry = entries_[e];
      for (const ArgSlot& slot : entry.slots) {
        if (slot.storage.valid()) {
          const bool written = std::find(entry.writes.begin(), entry.writes.end(), slot.storage) !=
              entry.writes.end();
          needed.push_back({slot.storage, slot.state, written});
        }
      }
    }
  };
  // A worklist, not recursion: chains of thousands of ops are common.
  while (!needed.empty()) {
    const auto [s, st, written] = needed.back();
    needed.pop_back();
    if (!written) {
      c10::Storage memo = storages_[s].memo.at_state(st);
      if (memo) {
        plan.memos.try_emplace(s, std::move(memo), st);
        continue;
      }
    }
    const StorageRecord& record = storages_[s];
    auto [it, inserted] = plan.states.try_emplace(s, StateId(0));
    if (inserted) {
      TORCH_INTERNAL_ASSERT(record.producer.valid(), "torch_sac: no op to replay for a storage");
      add_entry(record.producer);
    }
    // In tape order a consumer sees the storage at the state it recorded:
    // the writes before it are replayed before it, the later ones after.
    for (StateId k = it->second; k < st; k = k.next()) {
      add_entry(record.mutations[k]);
    }
    it->second = std::max(it->second, st);
  }
  std::sort(plan.entries.begin(), plan.entries.end());
  return plan;
}

c10::Storage Region::materialize(StorageId storage, StateId state, ScopeId scope) {
  if (c10::Storage memo = storages_[storage].memo.at_state(state)) {
    return memo;
  }
  const ReplayPlan plan = plan_rebuild(storage, state);
  // The last plan entry that uses each rebuilt storage.
  std::unordered_map<StorageId, EntryId> last_use;
  for (EntryId e : plan.entries) {
    for (const ArgSlot& slot : entries_[e].slots) {
      if (slot.storage.valid() && plan.states.count(slot.storage)) {
        last_use[slot.storage] = e;
      }
    }
    for (const auto& [position, s] : entries_[e].produced) {
      if (plan.states.count(s)) {
        last_use.try_emplace(s, e);
      }
    }
  }
  const std::optional<std::unordered_set<StorageId>> allowed = memos_allowed(plan, storage, scope);
  if (executed_.size() == 1) {
    stats_.first_rebuild_replayed_ops = static_cast<int64_t>(plan.entries.size());
  }
  auto may_keep = [&](StorageId s, StateId st) {
    return worth_memoising(s, st) && (!allowed || allowed->count(s) > 0);
  };
  // Rebuilt storages with their current state.
  std::unordered_map<StorageId, std::pair<at::Tensor, StateId>> working;
  for (EntryId e : plan.entries) {
    const Entry& entry = entries_[e];
    auto resolve = [&](const ArgSlot& slot) -> at::Tensor {
      if (slot.held.defined()) {
        check_held(slot, entry);
        return slot.held;
      }
      auto w = working.find(slot.storage);
      if (w != working.end() && w->second.second == slot.state) {
        return slot.geometry.view_of(w->second.first.storage());
      }
      auto m = plan.memos.find(slot.storage);
      TORCH_INTERNAL_ASSERT(
          m != plan.memos.end() && m->second.second == slot.state,
          "torch_sac: replay plan missed a storage ", entries_[e].op.operator_name());
      return slot.geometry.view_of(m->second.first);
    };
    const torch::jit::Stack outputs = replay_entry(e, resolve);
    int32_t position = 0;
    auto produced = entry.produced.begin();
    for (const c10::IValue& out : outputs) {
      for_each_tensor(out, [&](const at::Tensor& t) {
        if (produced != entry.produced.end() && produced->first == position) {
          const StorageId s = produced->second;
          if (plan.states.count(s)) {
            working[s] = {t, StateId(0)};
          } else if (may_keep(s, StateId(0))) {
            // A sibling backward will soon need too (layer norm's mean, rstd).
            memoise(s, t, StateId(0));
          }
          ++produced;
        }
        ++position;
      });
    }
    for (StorageId s : entry.writes) {
      auto w = working.find(s);
      if (w != working.end()) {
        w->second.second = w->second.second.next();
      }
    }
    // Intermediates past their last use go now; ones autograd will unpack
    // later in this backward stay as memos.
    for (auto it = working.begin(); it != working.end();) {
      const StorageId s = it->first;
      if (s != storage && last_use.at(s) == e) {
        if (may_keep(s, it->second.second)) {
          memoise(s, it->second.first, it->second.second);
        } else if (worth_memoising(s, it->second.second)) {
          ++stats_.memos_skipped;
        }
        it = working.erase(it);
      } else {
        ++it;
      }
    }
  }
  auto target = working.find(storage);
  TORCH_INTERNAL_ASSERT(
      target != working.end() && target->second.second == state,
      "torch_sac: replay did not rebuild the storage at the state autograd saved");
  const at::Tensor result = std::move(target->second.first);
  memoise(storage, result, state);
  release_after_rebuild(storage);
  stats_.peak_memo_bytes = std::max(stats_.peak_memo_bytes, strong_memo_bytes());
  if (budget_counts_saved_) {
    stats_.peak_held_bytes = std::max(stats_.peak_held_bytes, budgeted_bytes());
  }
  return result.storage();
}

void Region::release_after_rebuild(StorageId target) {
  if (!schedule_ && replay_budget_ == kNoReplayBudget) {
    return;
  }
  std::vector<StorageId> held;
  for (StorageId s : memoised_) {
    if (s != target && storages_[s].memo.strong()) {
      held.push_back(s);
    }
  }
  std::vector<StorageId> released;
  if (schedule_) {
    const size_t rebuild = executed_.size() - 1;
    const StoragesByKey by_key(*this, held);
    for (const TensorKey& key : (*schedule_)[rebuild].release) {
      const StorageId found = by_key.find(key);
      TORCH_CHECK_VALUE(
          found.valid(), "torch_sac: replay schedule rebuild #", rebuild, " releases ",
          describe_key(key),
          ", which the region does not hold at that point (never kept, or already unpacked "
          "for the last time).");
      released.push_back(found);
    }
  } else {
    // Earlier targets still waiting for unpacks are held too: let go of the
    // earliest in the tape first (backward reaches them last); one still
    // alive elsewhere is served from there, the others are rebuilt.
    std::sort(held.begin(), held.end(), [&](StorageId a, StorageId b) {
      return storages_[a].producer < storages_[b].producer;
    });
    int64_t bytes = budgeted_bytes();
    for (StorageId s : held) {
      if (bytes <= replay_budget_) {
        break;
      }
      bytes -= storages_[s].memo.strong_bytes();
      released.push_back(s);
    }
  }
  for (StorageId s : released) {
    storages_[s].memo.weaken();
    ++stats_.memos_skipped;
    executed_.back().release.push_back(executed_key_of(s));
  }
}

std::vector<StorageId> Region::memo_candidates(const ReplayPlan& plan, StorageId target) const {
  std::vector<StorageId> candidates;
  for (EntryId e : plan.entries) {
    for (const auto& [position, s] : entries_[e].produced) {
      const auto rebuilt = plan.states.find(s);
      const StateId state = rebuilt == plan.states.end() ? StateId(0) : rebuilt->second;
      if (s != target && worth_memoising(s, state)) {
        candidates.push_back(s);
      }
    }
  }
  return candidates;
}

bool Region::encloses(ScopeId outer, ScopeId inner) const {
  for (ScopeId s = inner; s.valid(); s = scope_parents_[s]) {
    if (s == outer) {
      return true;
    }
  }
  return false;
}

bool Region::nesting_allows(StorageId candidate, ScopeId scope) const {
  const StorageRecord& record = storages_[candidate];
  if (encloses(entries_[record.producer].scope, scope)) {
    return true;
  }
  return std::any_of(record.reader_scopes.begin(), record.reader_scopes.end(), [&](ScopeId reader) {
    return encloses(reader, scope);
  });
}

std::optional<std::unordered_set<StorageId>> Region::memos_allowed(
    const ReplayPlan& plan,
    StorageId target,
    ScopeId scope) {
  std::vector<StorageId> candidates = memo_candidates(plan, target);
  const size_t rebuild = executed_.size();
  std::optional<std::unordered_set<StorageId>> allowed;
  if (!schedule_ && scope_parents_.size() > 1) {
    const auto nested = std::remove_if(candidates.begin(), candidates.end(), [&](StorageId s) {
      return !nesting_allows(s, scope);
    });
    if (nested != candidates.end()) {
      candidates.erase(nested, candidates.end());
      if (replay_budget_ == kNoReplayBudget) {
        allowed.emplace(candidates.begin(), candidates.end());
      }
    }
  }
  if (schedule_) {
    allowed = memos_scheduled(target, candidates, rebuild);
  } else if (replay_budget_ != kNoReplayBudget) {
    const auto start = std::chrono::steady_clock::now();
    allowed = memos_within_budget(plan, target, candidates);
    stats_.budget_choice_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now() - start)
                                   .count();
  }
  ExecutedStep step{executed_key_of(target), {}, {}};
  for (StorageId s : candidates) {
    if (!allowed || allowed->count(s)) {
      step.keep.push_back(executed_key_of(s));
    }
  }
  executed_.push_back(std::move(step));
  return allowed;
}

Region::ExecutedKey Region::executed_key_of(StorageId storage) const {
  const StorageRecord& record = storages_[storage];
  const Entry& producer = entries_[record.producer];
  return {producer.op_index, producer.call_index, record.producer_output};
}

Region::StoragesByKey::StoragesByKey(const Region& region, const std::vector<StorageId>& storages) {
  for (StorageId s : storages) {
    const ExecutedKey k = region.executed_key_of(s);
    by_key_.emplace(std::make_tuple(k.op_index, k.call_index, k.output), s);
  }
  for (size_t i = 0; i < region.ops_.size(); ++i) {
    op_index_.emplace(region.ops_[i].facts->name, static_cast<int32_t>(i));
  }
}

StorageId Region::StoragesByKey::find(const TensorKey& key) const {
  const auto op = op_index_.find(key.op);
  if (op == op_index_.end()) {
    return StorageId::invalid();
  }
  const auto found = by_key_.find(std::make_tuple(op->second, key.call_index, key.output));
  return found == by_key_.end() ? StorageId::invalid() : found->second;
}

TensorKey Region::key_of(StorageId storage) const {
  const ExecutedKey key = executed_key_of(storage);
  return {ops_[key.op_index].facts->name, key.call_index, key.output};
}

std::string Region::describe_key(const TensorKey& key) const {
  std::ostringstream out;
  out << key.op << " (call " << key.call_index << ", output " << key.output << ")";
  return out.str();
}

std::unordered_set<StorageId> Region::memos_scheduled(
    StorageId target,
    const std::vector<StorageId>& candidates,
    size_t rebuild) const {
  TORCH_CHECK_VALUE(
      rebuild < schedule_->size(), "torch_sac: the replay schedule has ", schedule_->size(),
      " rebuilds, but backward needs "
      "another one, to rebuild ",
      describe_key(key_of(target)),
      ". The schedule was made for "
      "another program, other inputs or another policy: record it again "
      "(region.replay_schedule()) from a run of this one.");
  const RebuildStep& step = (*schedule_)[rebuild];
  const TensorKey unpacked = key_of(target);
  TORCH_CHECK_VALUE(
      step.unpacked == unpacked, "torch_sac: replay schedule rebuild #", rebuild, " is for ",
      describe_key(step.unpacked), ", but backward unpacked ", describe_key(unpacked),
      " there. The schedule was made for "
      "another program, other inputs or another policy, or it keeps tensors a different "
      "schedule keeps; or backward runs in another order or in several passes than the "
      "recorded run (a schedule covers one pass, the last one the region ran; a second "
      "backward or autograd.grad reading the same tensors starts a new pass): record it "
      "again (region.replay_schedule()) from a run of this one.");
  const StoragesByKey by_key(*this, candidates);
  std::unordered_set<StorageId> allowed;
  for (const TensorKey& key : step.keep) {
    const StorageId found = by_key.find(key);
    TORCH_CHECK_VALUE(
        found.valid(), "torch_sac: replay schedule rebuild #", rebuild, " (for ",
        describe_key(unpacked), ") keeps ", describe_key(key),
        ", which this rebuild does not make, or which "
        "autograd will not unpack again. A rebuild can keep only the tensors it rebuilds "
        "on its way that backward still needs.");
    allowed.insert(found);
  }
  return allowed;
}

std::unordered_set<StorageId> Region::memos_within_budget(
    const ReplayPlan& plan,
    StorageId target,
    const std::vector<StorageId>& candidates) {
  const std::unordered_set<StorageId> is_candidate(candidates.begin(), candidates.end());
  const auto m = static_cast<int32_t>(plan.entries.size());
  // Where each storage the plan rebuilds is made and last read in it.
  std::unordered_map<StorageId, int32_t> made_at; // plan positions
  std::unordered_map<StorageId, int32_t> last_read_at;
  std::vector<double> cost_through(m);
  double cost = 0;
  for (int32_t i = 0; i < m; ++i) {
    const Entry& entry = entries_[plan.entries[i]];
    cost += entry.replay_cost;
    cost_through[i] = cost;
    for (const ArgSlot& slot : entry.slots) {
      if (!slot.held.defined() && made_at.count(slot.storage)) {
        last_read_at[slot.storage] = i;
      }
    }
    for (const auto& [position, s] : entry.produced) {
      made_at.emplace(s, i);
    }
  }
  // Cuts: after op p, the storages made at or before p and read after it.
  // A cut is a checkpoint only if all of them are candidates (the returned
  // tensor is held anyway and costs nothing more).
  std::vector<std::vector<StorageId>> made(m), done(m);
  for (const auto& [s, last] : last_read_at) {
    made[made_at.at(s)].push_back(s);
    done[last].push_back(s);
  }
  auto bytes_of = [&](StorageId s) { return s == target ? int64_t{0} : storages_[s].nbytes; };
  auto unkeepable = [&](StorageId s) { return s != target && !is_candidate.count(s) ? 1 : 0; };
  std::vector<ReplayCut> cuts;
  std::vector<int32_t> cut_after;
  int64_t crossing_bytes = 0;
  int32_t crossing = 0;
  int32_t crossing_unkeepable = 0;
  for (int32_t p = 0; p + 1 < m; ++p) {
    for (StorageId s : made[p]) {
      crossing_bytes += bytes_of(s);
      ++crossing;
      crossing_unkeepable += unkeepable(s);
    }
    for (StorageId s : done[p]) {
      crossing_bytes -= bytes_of(s);
      --crossing;
      crossing_unkeepable -= unkeepable(s);
    }
    if (crossing > 0 && crossing_unkeepable == 0) {
      cuts.push_back({cost_through[p], crossing_bytes});
      cut_after.push_back(p);
    }
  }
  // The tensor being rebuilt is returned to autograd, and counts.
  const int64_t free_bytes = replay_budget_ - budgeted_bytes() - storages_[target].nbytes;
  std::unordered_set<StorageId> allowed;
  // What the unpacks right after this one need: the candidates past the
  // last cut.
  int64_t tail_bytes = 0;
  for (StorageId s : candidates) {
    if (cut_after.empty() || made_at.at(s) > cut_after.back()) {
      tail_bytes += storages_[s].nbytes;
    }
  }
  const CheckpointChoice choice = choose_checkpoints(
      cuts, cost, free_bytes, tail_bytes, checkpoint_share_);
  stats_.spaced_choices += choice.spaced ? 1 : 0;
  const std::vector<size_t>& chosen = choice.cuts;
  if (!chosen.empty()) {
    // Sweep again, collecting what crosses each chosen cut.
    std::unordered_set<StorageId> live;
    size_t next = 0;
    for (int32_t p = 0; p + 1 < m && next < chosen.size(); ++p) {
      live.insert(made[p].begin(), made[p].end());
      for (StorageId s : done[p]) {
        live.erase(s);
      }
      if (p == cut_after[chosen[next]]) {
        allowed.insert(live.begin(), live.end());
        ++next;
      }
    }
    allowed.erase(target);
  }
  int64_t used = 0;
  for (StorageId s : allowed) {
    used += storages_[s].nbytes;
  }
  // The tail autograd unpacks next, as far back as the rest allows.
  for (auto it = candidates.rbegin(); it != candidates.rend(); ++it) {
    if (allowed.count(*it)) {
      continue;
    }
    if (used + storages_[*it].nbytes > free_bytes) {
      break;
    }
    allowed.insert(*it);
    used += storages_[*it].nbytes;
  }
  // Empty tensors cost nothing to keep.
  for (StorageId s : candidates) {
    if (storages_[s].nbytes == 0) {
      allowed.insert(s);
    }
  }
  return allowed;
}

void Region::set_replay_schedule(ReplaySchedule schedule) {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK_VALUE(
      replay_budget_ == kNoReplayBudget,
      "torch_sac: a region takes a replay_budget or a replay_schedule, not both: the schedule "
      "already says what each rebuild keeps.");
  schedule_ = std::move(schedule);
}

ReplaySchedule Region::executed_schedule() const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto named = [&](const ExecutedKey& key) {
    return TensorKey{ops_[key.op_index].facts->name, key.call_index, key.output};
  };
  ReplaySchedule schedule;
  schedule.reserve(executed_.size());
  for (const ExecutedStep& step : executed_) {
    RebuildStep named_step{named(step.unpacked), {}, {}};
    for (const ExecutedKey& key : step.keep) {
      named_step.keep.push_back(named(key));
    }
    for (const ExecutedKey& key : step.release) {
      named_step.release.push_back(named(key));
    }
    schedule.push_back(std::move(named_step));
  }
  return schedule;
}

int64_t Region::strong_memo_bytes() const {
  int64_t bytes = 0;
  for (StorageId s : memoised_) {
    bytes += storages_[s].memo.strong_bytes();
  }
  return bytes;
}

int64_t Region::budgeted_bytes() const {
  int64_t bytes = strong_memo_bytes();
  if (budget_counts_saved_) {
    // A kept output is alive while autograd (or the region, for replays)
    // still holds it; its record pins the address, not the memory.
    for (const StorageRecord& record : storages_) {
      if (record.producer.valid() && !record.replayable && !record.identity.expired()) {
        bytes += record.nbytes;
      }
    }
  }
  return bytes;
}

// A rebuilt storage met on the way is kept when autograd will still unpack
// it at that state. Saved activations of a storage are all at its last
// state: one saved before a later in-place write fails the version check.
bool Region::worth_memoising(StorageId storage, StateId state) const {
  const StorageRecord& record = storages_[storage];
  return record.pending_unpacks > 0 && !record.memo.strong() && state == record.mutations.next_id();
}

void Region::memoise(StorageId storage, const at::Tensor& t, StateId state) {
  StorageRecord& record = storages_[storage];
  if (!record.memo.listed()) {
    memoised_.push_back(storage);
  }
  record.memo.hold(t.storage(), state, StreamStamp::current_for(t));
}

void Region::set_storage_restorer(StorageRestorer restorer) {
  std::lock_guard<std::mutex> lock(mutex_);
  restorer_ = std::move(restorer);
}

void Region::check_held(const ArgSlot& slot, const Entry& consumer) {
  const std::string& op = ops_[consumer.op_index].facts->name;
  const std::string& arg = consumer.op.schema().arguments()[slot.arg].name();
  const TensorGeometry geometry = TensorGeometry::of(slot.held);
  if (!geometry.fits(slot.held.storage()) && restorer_.restore && restorer_.restore(slot.held)) {
    restored_in_replay_ = true;
  }
  TORCH_CHECK(
      geometry.fits(slot.held.storage()), "torch_sac: replaying ", op,
      " in backward needs its argument '", arg, "', ", describe(slot.held),
      ", which was kept from forward, but its storage now holds ", slot.held.storage().nbytes(),
      " bytes where the op read ", geometry.nbytes(),
      ": it was freed or resized after forward (FSDP2 with reshard_after_forward=True "
      "frees unsharded parameters this way). Put the region inside the module that owns "
      "the tensor (one sac_context per fully_shard-ed module), keep the tensor allocated "
      "until backward, or make the policy save the ops that read it.");
  const uint32_t now = version_of(slot.held);
  if (now == slot.version) {
    return;
  }
  const bool from_region = find_storage(slot.held).valid();
  if (from_region && allow_cache_entry_mutation_) {
    return;
  }
  TORCH_CHECK(
      false,
      "one of the variables needed for gradient computation has been modified "
      "by an inplace operation: ",
      describe(slot.held), " is at version ", now, "; expected version ", slot.version,
      " instead. (torch_sac: replaying ", op, " needs its argument '", arg, "', ",
      from_region ? "an output the policy saved, which was modified in place after "
                    "the op used it. Make the policy recompute the op that made it, "
                    "or pass allow_cache_entry_mutation=True if the new value is "
                    "intended.)"
                  : "a tensor from outside the sac_context region, which was modified "
                    "in place after the region used it.)");
}

torch::jit::Stack Region::replay_entry(
    EntryId entry_index,
    c10::function_ref<at::Tensor(const ArgSlot&)> resolve) {
  // Entries are never added during replay, so the reference stays valid.
  const Entry& entry = entries_[entry_index];
  TORCH_INTERNAL_ASSERT(
      entry.replayable, "torch_sac: entry ", entry_index.value, " cannot be replayed");
  torch::jit::Stack stack(entry.args.begin(), entry.args.end());
  int64_t copied_list = -1;
  for (const ArgSlot& slot : entry.slots) {
    at::Tensor t = resolve(slot);
    c10::IValue& arg = stack[slot.arg];
    if (slot.element < 0) {
      arg = std::move(t);
      continue;
    }
    // Lists are shared by reference: fill a copy, never the recorded one.
    if (copied_list != slot.arg) {
      arg = arg.isTensorList() ? c10::IValue(arg.toTensorList().copy())
                               : c10::IValue(arg.toList().copy());
      copied_list = slot.arg;
    }
    if (arg.isTensorList()) {
      arg.toTensorList().set(slot.element, std::move(t));
    } else {
      arg.toList().set(slot.element, std::move(t));
    }
  }
  for (const ArgSlot& slot : entry.slots) {
    record_use_on_current_stream(slot.held);
  }
  const auto start = std::chrono::steady_clock::now();
  {
    ReplayGuard guard;
    NumericsGuard numerics(entry.numerics);
    for (uint32_t i : entry.scratch_args) {
      record_use_on_current_stream(stack[i].toTensor());
      stack[i] = stack[i].toTensor().clone();
    }
    auto run = [&] { entry.op.callBoxed(stack); };
    if (entry.rng) {
      entry.rng->replay(stack, run);
    } else {
      run();
    }
  }
  const int64_t elapsed = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::steady_clock::now() - start)
                              .count();
  stats_.replay_ns += elapsed;
  ++stats_.replayed_ops;
  stats_.replayed_cost += static_cast<int64_t>(entry.replay_cost);
  OpInfo& info = ops_[entry.op_index];
  ++info.replayed;
  info.replay_ns += elapsed;
  if (info.replays_by_call.size() <= static_cast<size_t>(entry.call_index)) {
    info.replays_by_call.resize(static_cast<size_t>(entry.call_index) + 1, 0);
  }
  ++info.replays_by_call[static_cast<size_t>(entry.call_index)];
  return stack;
}

void Region::release_memos() {
  size_t kept = 0;
  for (StorageId s : memoised_) {
    Memo& memo = storages_[s].memo;
    if (storages_[s].pending_unpacks <= 0) {
      memo.weaken();
    }
    if (memo.gone()) {
      memo.clear();
    } else {
      memoised_[kept++] = s;
    }
  }
  memoised_.resize(kept);
}

} // namespace torch_sac::region
