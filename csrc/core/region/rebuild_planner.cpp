// Planning a rebuild and choosing what it keeps (rebuild_planner.h).

#include "csrc/core/region/rebuild_planner.h"

#include <algorithm>
#include <chrono>
#include <sstream>

namespace torch_sac::region {

ReplayPlan RebuildPlanner::plan(StorageId storage, StateId state) const {
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
      const Entry& entry = tape_.entries[e];
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

void RebuildPlanner::release_after_rebuild(StorageId target) {
  if (!schedule_ && replay_budget_ == kNoReplayBudget) {
    return;
  }
  std::vector<StorageId> held;
  for (StorageId s : storages_.memoised()) {
    if (s != target && storages_[s].memo.strong() && !storages_[s].pinned) {
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

std::vector<StorageId> RebuildPlanner::memo_candidates(const ReplayPlan& plan, StorageId target)
    const {
  std::vector<StorageId> candidates;
  for (EntryId e : plan.entries) {
    for (const auto& [position, s] : tape_.entries[e].produced) {
      const auto rebuilt = plan.states.find(s);
      const StateId state = rebuilt == plan.states.end() ? StateId(0) : rebuilt->second;
      if (s != target && storages_.worth_memoising(s, state)) {
        candidates.push_back(s);
      }
    }
  }
  return candidates;
}

bool RebuildPlanner::nesting_allows(StorageId candidate, ScopeId scope) const {
  const StorageRecord& record = storages_[candidate];
  if (tape_.encloses(tape_.entries[record.producer].scope, scope)) {
    return true;
  }
  return std::any_of(record.reader_scopes.begin(), record.reader_scopes.end(), [&](ScopeId reader) {
    return tape_.encloses(reader, scope);
  });
}

std::optional<std::unordered_set<StorageId>> RebuildPlanner::memos_allowed(
    const ReplayPlan& plan,
    StorageId target,
    ScopeId scope) {
  std::vector<StorageId> candidates = memo_candidates(plan, target);
  const size_t rebuild = executed_.size();
  std::optional<std::unordered_set<StorageId>> allowed;
  if (!schedule_ && tape_.nested()) {
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

RebuildPlanner::ExecutedKey RebuildPlanner::executed_key_of(StorageId storage) const {
  const StorageRecord& record = storages_[storage];
  const Entry& producer = tape_.entries[record.producer];
  return {producer.op_index, producer.call_index, record.producer_output};
}

RebuildPlanner::StoragesByKey::StoragesByKey(
    const RebuildPlanner& planner,
    const std::vector<StorageId>& storages) {
  for (StorageId s : storages) {
    const ExecutedKey k = planner.executed_key_of(s);
    by_key_.emplace(std::make_tuple(k.op_index, k.call_index, k.output), s);
  }
  for (size_t i = 0; i < planner.tape_.ops.size(); ++i) {
    op_index_.emplace(planner.tape_.ops[i].facts->name, static_cast<int32_t>(i));
  }
}

StorageId RebuildPlanner::StoragesByKey::find(const TensorKey& key) const {
  const auto op = op_index_.find(key.op);
  if (op == op_index_.end()) {
    return StorageId::invalid();
  }
  const auto found = by_key_.find(std::make_tuple(op->second, key.call_index, key.output));
  return found == by_key_.end() ? StorageId::invalid() : found->second;
}

TensorKey RebuildPlanner::key_of(StorageId storage) const {
  const ExecutedKey key = executed_key_of(storage);
  return {tape_.ops[key.op_index].facts->name, key.call_index, key.output};
}

std::string RebuildPlanner::describe_key(const TensorKey& key) const {
  std::ostringstream out;
  out << key.op << " (call " << key.call_index << ", output " << key.output << ")";
  return out.str();
}

std::unordered_set<StorageId> RebuildPlanner::memos_scheduled(
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

std::unordered_set<StorageId> RebuildPlanner::memos_within_budget(
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
    const Entry& entry = tape_.entries[plan.entries[i]];
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

ReplaySchedule RebuildPlanner::executed_schedule() const {
  auto named = [&](const ExecutedKey& key) {
    return TensorKey{tape_.ops[key.op_index].facts->name, key.call_index, key.output};
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

int64_t RebuildPlanner::budgeted_bytes() const {
  int64_t bytes = storages_.strong_memo_bytes();
  if (budget_counts_saved_) {
    // A kept output is alive while autograd (or the region, for replays)
    // still holds it; its record pins the address, not the memory.
    for (const StorageRecord& record : storages_.records()) {
      if (record.producer.valid() && !record.replayable && !record.identity.expired()) {
        bytes += record.nbytes;
      }
    }
  }
  return bytes;
}

void RebuildPlanner::set_schedule(ReplaySchedule schedule) {
  TORCH_CHECK_VALUE(
      replay_budget_ == kNoReplayBudget,
      "torch_sac: a region takes a replay_budget or a replay_schedule, not both: the schedule "
      "already says what each rebuild keeps.");
  schedule_ = std::move(schedule);
}

} // namespace torch_sac::region
