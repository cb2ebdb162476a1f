// Rebuilding dropped activations by replaying the region's tape.

#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <chrono>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "csrc/core/detached_alias.h"
#include "csrc/core/ivalue_tensors.h"
#include "csrc/core/region/c10d_objects.h"
#include "csrc/core/region/region.h"
#include "csrc/core/replay_guard.h"
#include "csrc/core/tensor_version.h"

namespace torch_sac::region {
namespace {

std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << "[" << t.toString() << " " << t.sizes() << "]";
  return out.str();
}

// A replayed collective is waited for at once: its consumers in the replay
// read its output next, and nothing else would wait. A functional one's
// outputs through wait_tensor, a c10d one's through the Work it returns.
void wait_for_collective(const OpFacts& facts, const torch::jit::Stack& outputs) {
  if (facts.filled_buffer) {
    wait_c10d_works(outputs);
    return;
  }
  static const c10::OperatorHandle wait = c10::Dispatcher::singleton().findSchemaOrThrow(
      "_c10d_functional::wait_tensor", "");
  for (const c10::IValue& out : outputs) {
    for_each_tensor(out, [&](const at::Tensor& t) {
      if (t.defined()) {
        torch::jit::Stack stack{t};
        wait.callBoxed(stack);
      }
    });
  }
}

} // namespace

at::Tensor unpack(const SavedActivation& saved) {
  if (saved.region) {
    return saved.region->rebuild(saved);
  }
  if (saved.offloaded.defined()) {
    return saved.offloaded.reload();
  }
  if (saved.kept.defined()) {
    const uint32_t now = current_version(saved.version_counter);
    if (now != saved.version) {
      throw_modified_in_place(
          describe(saved.kept), now, saved.version,
          "the tensor was saved for backward inside a sac_context region");
    }
  }
  return saved.kept;
}

// While alive, a rebuild holding the region's mutex runs on this thread:
// activations its own code frees are forgotten when it ends (region.h).
class ReplayOnThisThread {
 public:
  explicit ReplayOnThisThread(Region& region) : region_(region) {
    region_.replaying_thread_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  }
  ~ReplayOnThisThread() {
    region_.replaying_thread_.store(std::thread::id(), std::memory_order_relaxed);
    region_.forget_deferred();
  }
  ReplayOnThisThread(const ReplayOnThisThread&) = delete;
  ReplayOnThisThread& operator=(const ReplayOnThisThread&) = delete;

 private:
  Region& region_;
};

at::Tensor Region::rebuild(const SavedActivation& saved) {
  // The views and aliases made here are the region's own bookkeeping: a
  // region open on this thread (backward inside the `with` block) must not
  // record them, and this one would deadlock on its own mutex.
  const c10::impl::ExcludeDispatchKeyGuard not_intercepted(kInterceptKey);
  std::lock_guard<std::mutex> lock(mutex_);
  const ReplayOnThisThread replaying(*this); // ends before the lock is released
  StorageRecord& record = storages_.at(saved.storage);
  const uint32_t now = current_version(saved.version_counter);
  if (now != saved.version) {
    throw_modified_in_place(
        c10::str("a tensor of shape ", c10::IntArrayRef(saved.geometry.sizes)), now, saved.version,
        "it was saved for backward inside a sac_context region and dropped by the policy");
  }
  const int task = torch::autograd::get_current_graph_task_id();
  const bool same_backward = task >= 0 && task == saved.unpacked_task;
  if (saved.unpacked_pass == storages_.pass() && !same_backward) {
    start_new_pass(); // backward runs again (retain_graph=True)
  }
  if (saved.unpacked_pass != storages_.pass()) {
    saved.unpacked_pass = storages_.pass();
    storages_.mark_unpacked(saved.storage);
  }
  saved.unpacked_task = task;
  replay_collectives_for(saved);
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
  const c10::Storage base = materialize_restoring(saved.storage, saved.state, saved.scope);
  at::Tensor result = saved.geometry.view_of(base);
  result.unsafeGetTensorImpl()->set_version_counter(record.memo.version());
  move_pins_downstream();
  storages_.release_memos();
  return result;
}

c10::Storage Region::materialize_restoring(StorageId storage, StateId state, ScopeId scope) {
  restored_in_replay_ = false;
  c10::Storage base;
  try {
    base = materialize(storage, state, scope);
  } catch (...) {
    if (restored_in_replay_ && restorer_.done) {
      restorer_.done();
    }
    throw;
  }
  if (restored_in_replay_ && restorer_.done) {
    restorer_.done();
  }
  return base;
}

void Region::replay_collectives_for(const SavedActivation& saved) {
  for (EntryId collective : storages_.at(saved.storage).collective_deps) {
    const Entry& entry = tape_.entries[collective];
    // What it made, or the buffer it filled (c10d's).
    const StorageId output = !entry.produced.empty() ? entry.produced.front().second
        : !entry.writes.empty()                      ? entry.writes.front()
                                                     : StorageId::invalid();
    TORCH_INTERNAL_ASSERT(
        output.valid() && storages_[output].collective == collective,
        "torch_sac: a replayed collective has no output");
    if (!storages_[output].pinned) {
      materialize_restoring(output, storages_[output].collective_state, saved.scope);
      ++stats_.collective_replays;
    }
  }
}

const std::vector<EntryId>& Region::readers_of(StorageId storage) {
  auto [it, inserted] = pin_readers_.try_emplace(storage);
  if (inserted) {
    // Those after what it holds was made: its collective (which for a c10d
    // one also reads the empty buffer), or else its producer.
    const StorageRecord& record = storages_[storage];
    const EntryId made = record.collective.valid() ? record.collective : record.producer;
    for (size_t e = made.valid() ? made.index() + 1 : 0; e < tape_.entries.size(); ++e) {
      for (const ArgSlot& slot : tape_.entries[EntryId::at(e)].slots) {
        if (slot.storage == storage) {
          it->second.push_back(EntryId::at(e));
          break;
        }
      }
    }
  }
  return it->second;
}

std::vector<StorageId> Region::move_pins_downstream() {
  std::vector<StorageId> moved;
  if (open_) {
    // Backward inside the `with` block: forward may still record readers
    // that readers_of() would not know of. Pins stay as they are.
    return moved;
  }
  // A copy: pinning appends to the list.
  const std::vector<StorageId> pinned = storages_.pinned();
  for (StorageId from : pinned) {
    const StorageRecord& record = storages_[from];
    if (record.pin_moved || record.live_refs > 0 || !record.memo.strong()) {
      continue; // moved already, or saved for backward itself
    }
    std::vector<StorageId> targets;
    int64_t bytes = 0;
    bool covered = true;
    for (EntryId reader : readers_of(from)) {
      const Entry& entry = tape_.entries[reader];
      if (!entry.replayable) {
        continue; // released (past every live horizon): never replayed again
      }
      if (!entry.writes.empty()) {
        covered = false; // what it writes would need `from` too
        break;
      }
      for (const auto& [position, out] : entry.produced) {
        const StorageRecord& made = storages_[out];
        if (made.pinned || std::find(targets.begin(), targets.end(), out) != targets.end()) {
          continue;
        }
        if (!made.mutations.empty() || !made.memo.strong() || !made.memo.at_state(StateId(0))) {
          covered = false;
          break;
        }
        bytes += made.nbytes;
        targets.push_back(out);
      }
      if (!covered) {
        break;
      }
    }
    if (!covered || bytes > record.nbytes) {
      continue;
    }
    for (StorageId s : targets) {
      storages_.pin_memo(s);
    }
    storages_.move_pin(from);
    moved.push_back(from);
  }
  return moved;
}

void Region::start_new_pass() {
  storages_.start_new_pass();
  planner_.start_new_pass();
}

c10::Storage Region::materialize(StorageId storage, StateId state, ScopeId scope) {
  if (c10::Storage memo = storages_[storage].memo.at_state(state)) {
    return memo;
  }
  ReplayPlan plan = planner_.plan(storage, state);
  // The last plan entry that uses each rebuilt storage.
  std::unordered_map<StorageId, EntryId> last_use;
  for (EntryId e : plan.entries) {
    for (const ArgSlot& slot : tape_.entries[e].slots) {
      if (slot.storage.valid() && plan.states.count(slot.storage)) {
        last_use[slot.storage] = e;
      }
    }
    for (const auto& [position, s] : tape_.entries[e].produced) {
      if (plan.states.count(s)) {
        last_use.try_emplace(s, e);
      }
    }
  }
  const std::optional<std::unordered_set<StorageId>> allowed = planner_.memos_allowed(
      plan, storage, scope);
  if (planner_.rebuilds() == 1) {
    stats_.first_rebuild_replayed_ops = static_cast<int64_t>(plan.entries.size());
  }
  auto may_keep = [&](StorageId s, StateId st) {
    return storages_.worth_memoising(s, st) && (!allowed || allowed->count(s) > 0);
  };
  // Rebuilt storages with their current state.
  std::unordered_map<StorageId, std::pair<at::Tensor, StateId>> working;
  for (EntryId e : plan.entries) {
    const Entry& entry = tape_.entries[e];
    auto resolve = [&](const ArgSlot& slot) -> at::Tensor {
      if (slot.offloaded.defined()) {
        // As check_held: a change after forward is an error unless cache
        // entries may be mutated, or the host copy is known to hold the
        // value read (the write was seen, in this region or another, after
        // the copy); then the host copy is forward's value.
        return slot.offloaded.reload(
            /*check_version=*/!slot.preserved && !allow_cache_entry_mutation_ &&
            !slot.offloaded.host_copy_holds_offloaded_value());
      }
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
          "torch_sac: replay plan missed a storage ", tape_.entries[e].op.operator_name());
      return slot.geometry.view_of(m->second.first);
    };
    const torch::jit::Stack outputs = replay_entry(e, resolve);
    const OpFacts& facts = *tape_.ops[entry.op_index].facts;
    const bool collective = facts.replayable_collective && !facts.filled_buffer;
    int32_t position = 0;
    auto produced = entry.produced.begin();
    for (const c10::IValue& out : outputs) {
      for_each_tensor(out, [&](const at::Tensor& t) {
        if (produced != entry.produced.end() && produced->first == position) {
          const StorageId s = produced->second;
          if (collective) {
            // Held for the rest of the pass (StorageTable::pin).
            storages_.pin(s, t);
          }
          if (plan.states.count(s)) {
            working[s] = {t, StateId(0)};
          } else if (may_keep(s, StateId(0))) {
            // A sibling backward will soon need too (layer norm's mean, rstd).
            storages_.memoise(s, t, StateId(0));
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
        if (storages_[s].collective == e) {
          // The buffer a c10d collective filled: held for the rest of the
          // pass at this state (StorageTable::pin).
          storages_.pin(s, w->second.first);
        }
      }
    }
    // Intermediates past their last use go now; ones autograd will unpack
    // later in this backward stay as memos.
    bool memoised = false;
    for (auto it = working.begin(); it != working.end();) {
      const StorageId s = it->first;
      if (s != storage && last_use.at(s) == e) {
        if (may_keep(s, it->second.second)) {
          storages_.memoise(s, it->second.first, it->second.second);
          memoised = true;
        } else if (storages_.worth_memoising(s, it->second.second)) {
          ++stats_.memos_skipped;
        }
        it = working.erase(it);
      } else {
        ++it;
      }
    }
    if (memoised && !storages_.pinned().empty()) {
      // A pin moved now frees its storage now, not when the plan ends.
      for (StorageId moved : move_pins_downstream()) {
        plan.memos.erase(moved);
        if (moved != storage) {
          working.erase(moved);
        }
      }
    }
  }
  auto target = working.find(storage);
  TORCH_INTERNAL_ASSERT(
      target != working.end() && target->second.second == state,
      "torch_sac: replay did not rebuild the storage at the state autograd saved");
  const at::Tensor result = std::move(target->second.first);
  storages_.memoise(storage, result, state);
  planner_.release_after_rebuild(storage);
  stats_.peak_memo_bytes = std::max(stats_.peak_memo_bytes, storages_.strong_memo_bytes());
  if (planner_.budget_counts_saved()) {
    stats_.peak_held_bytes = std::max(stats_.peak_held_bytes, planner_.budgeted_bytes());
  }
  return result.storage();
}

void Region::set_replay_schedule(ReplaySchedule schedule) {
  std::lock_guard<std::mutex> lock(mutex_);
  planner_.set_schedule(std::move(schedule));
}

ReplaySchedule Region::executed_schedule() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return planner_.executed_schedule();
}

void Region::set_storage_restorer(StorageRestorer restorer) {
  std::lock_guard<std::mutex> lock(mutex_);
  restorer_ = std::move(restorer);
}

void Region::check_held(const ArgSlot& slot, const Entry& consumer) {
  const std::string& op = tape_.ops[consumer.op_index].facts->name;
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
  const bool from_region = storages_.find(slot.held).valid();
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
  const Entry& entry = tape_.entries[entry_index];
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
    auto run = [&] {
      entry.op.callBoxed(stack);
      if (const OpFacts& facts = *tape_.ops[entry.op_index].facts; facts.replayable_collective) {
        wait_for_collective(facts, stack);
      }
    };
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
  OpInfo& info = tape_.ops[entry.op_index];
  ++info.replayed;
  info.replay_ns += elapsed;
  if (info.replays_by_call.size() <= static_cast<size_t>(entry.call_index)) {
    info.replays_by_call.resize(static_cast<size_t>(entry.call_index) + 1, 0);
  }
  ++info.replays_by_call[static_cast<size_t>(entry.call_index)];
  return stack;
}

} // namespace torch_sac::region
