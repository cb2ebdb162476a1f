#include "csrc/core/region/region.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <utility>

#include "csrc/core/detached_alias.h"
#include "csrc/core/ivalue_tensors.h"
#include "csrc/core/region/replay_cost.h"
#include "csrc/core/replay_guard.h"
#include "csrc/core/tensor_kind.h"
#include "csrc/core/tensor_version.h"

namespace torch_sac::region {
namespace {

// The first tensor in `values` the region cannot record, or nullptr.
const char* first_unrecordable(c10::ArrayRef<c10::IValue> values) {
  const char* kind = nullptr;
  for (const c10::IValue& v : values) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (!kind) {
        kind = unrecordable_kind(t);
      }
    });
  }
  return kind;
}

// How an op's arguments or outputs take it past the region: "subclass"
// where a tensor carries the Python key (a subclass's __torch_dispatch__
// handles the op, and the region records the ops it runs on the inner
// tensors instead), "meta" where a tensor is on the meta device (shape
// inference, e.g. DTensor's sharding propagation on its first call: no
// memory, and its ops are not the program's), else nullptr.
const char* passes_through(c10::ArrayRef<c10::IValue> values) {
  const char* why = nullptr;
  for (const c10::IValue& v : values) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (why == nullptr && t.defined()) {
        if (t.key_set().has(c10::DispatchKey::Python)) {
          why = "subclass";
        } else if (t.is_meta()) {
          why = "meta";
        }
      }
    });
  }
  return why;
}

// The storages of the tensors in `values`.
std::vector<const c10::StorageImpl*> storages_in(c10::ArrayRef<c10::IValue> values) {
  std::vector<const c10::StorageImpl*> storages;
  for (const c10::IValue& v : values) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (t.defined() && t.has_storage()) {
        storages.push_back(t.storage().unsafeGetStorageImpl());
      }
    });
  }
  return storages;
}

// The region whose c10d collective is running on this thread: the ops its
// backend runs meanwhile come to that region's handle() (InterceptNestedOps)
// to have their outputs noted, not recorded.
thread_local const Region* tls_collective_running = nullptr;

class CollectiveRunning {
 public:
  explicit CollectiveRunning(const Region* region)
      : previous_(std::exchange(tls_collective_running, region)) {}
  ~CollectiveRunning() {
    tls_collective_running = previous_;
  }
  CollectiveRunning(const CollectiveRunning&) = delete;
  CollectiveRunning& operator=(const CollectiveRunning&) = delete;

 private:
  const Region* previous_;
};

} // namespace

Region::Region(
    std::shared_ptr<OpPolicy> policy,
    bool allow_cache_entry_mutation,
    int64_t replay_budget,
    bool budget_counts_saved,
    double checkpoint_share)
    : allow_cache_entry_mutation_(allow_cache_entry_mutation),
      has_budget_(replay_budget != kNoReplayBudget),
      records_(!recording_disabled()),
      planner_(tape_, storages_, stats_, replay_budget, budget_counts_saved, checkpoint_share) {
  TORCH_CHECK(policy, "torch_sac: sac_context needs a policy");
  TORCH_CHECK_VALUE(
      replay_budget >= 0 || replay_budget == kNoReplayBudget,
      "torch_sac: sac_context's replay_budget must be a number of bytes >= 0 (or None for no "
      "budget), got ",
      replay_budget);
  TORCH_CHECK_VALUE(
      !budget_counts_saved || replay_budget != kNoReplayBudget,
      "torch_sac: a replay budget that counts saved outputs needs a number of bytes");
  TORCH_CHECK_VALUE(
      checkpoint_share > 0 && checkpoint_share <= 1,
      "torch_sac: a replay budget's checkpoint_share must be in (0, 1], got ", checkpoint_share);
  policies_.push_back(std::move(policy));
}

void Region::push_policy(std::shared_ptr<OpPolicy> policy) {
  TORCH_CHECK(policy, "torch_sac: sac_context needs a policy");
  std::lock_guard<std::mutex> lock(mutex_);
  policies_.push_back(std::move(policy));
  tape_.push_scope();
}

void Region::pop_policy() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(policies_.size() > 1, "torch_sac: pop_policy without a nested region");
  policies_.pop_back();
  tape_.pop_scope();
}

void Region::close() {
  // Policies are only asked in forward. Letting go of them here breaks
  // reference cycles through Python policies (a module whose bound method
  // is the policy and which keeps its region); they are destroyed after the
  // mutex is released, since a Python one takes the GIL to die.
  std::vector<std::shared_ptr<OpPolicy>> policies;
  CollectiveAgreement collectives;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = false;
    unreplayable_by_.clear(); // packs come in forward only
    backend_scratch_.clear();
    policies.swap(policies_);
    collectives = std::move(collectives_);
    release_unneeded_entries();
  }
  collectives.check();
}

void Region::release_unneeded_entries() {
  if (open_) {
    return;
  }
  if (!storages_.any_live()) {
    // Nothing can replay: the tape goes; the stats and op summary stay.
    tape_.clear();
    storages_.clear();
    pin_readers_.clear();
    return;
  }
  tape_.release_from(static_cast<size_t>(storages_.latest_horizon()));
  storages_.unpin_from(EntryId(storages_.latest_horizon()));
}

Policy Region::decide(const OpCall& call, const std::string& op_name) {
  Policy decision = policies_.front()->decide(call);
  for (size_t i = 1; i < policies_.size(); ++i) {
    decision = combine_policies(decision, policies_[i]->decide(call), op_name);
  }
  return decision;
}

// What an op about to run writes, found before it runs.
struct Region::Writes {
  std::vector<StorageId> storages;      // region storages it writes
  std::vector<c10::IValue> overwritten; // by argument: a copy of what it overwrites, or None
  bool may_replay = false;              // a replay may run it: it makes or writes replayable
};

Region::Unrecordable Region::unrecordable(const OpFacts& facts, c10::ArrayRef<c10::IValue> inputs) {
  // An op on a kind of tensor the region cannot replay (quantized, nested,
  // sparse, subclasses) runs as if outside the region: its outputs are not
  // tracked, so autograd keeps them. Nothing here may throw: such ops also
  // run inside autograd's own bookkeeping, where an exception aborts.
  // Collectives other than functional ones (c10d's in-place ones, autograd
  // and DTensor's own) are never replayed, and an op writing a list of
  // tensors (`_foreach_*_`, FSDP's split copies) is not tracked write by
  // write: both run as if outside.
  if (facts.collective && !facts.replayable_collective) {
    return {
        "a collective the region does not replay (functional ones, _c10d_functional::, "
        "and c10d's that fill a buffer, all_gather_into_tensor, reduce_scatter_tensor and "
        "all_to_all_single, are)"};
  }
  for (size_t i : facts.written_args) {
    if (inputs[i].isTensorList() || inputs[i].isList()) {
      return {"it writes a list of tensors"};
    }
  }
  if (const char* kind = first_unrecordable(inputs)) {
    return {"it reads ", kind};
  }
  return {};
}

std::string Region::unrecordable_reason(
    const OpFacts& facts,
    c10::ArrayRef<c10::IValue> inputs,
    c10::ArrayRef<c10::IValue> outputs) {
  if (const Unrecordable why = unrecordable(facts, inputs)) {
    return c10::str(why.cause, why.kind ? why.kind : "");
  }
  if (const char* kind = first_unrecordable(outputs)) {
    return c10::str("it makes ", kind);
  }
  return "it cannot be recorded";
}

void Region::note_unreplayable(
    int32_t op_index,
    const OpFacts& facts,
    c10::ArrayRef<c10::IValue> inputs,
    c10::ArrayRef<c10::IValue> outputs,
    const std::vector<StorageId>& written,
    const char* why) {
  auto note = [&](const c10::Storage& storage) {
    unreplayable_by_.insert_or_assign(
        storage.unsafeGetStorageImpl(), UnreplayableBy{storage.getWeakStorageImpl(), op_index});
  };
  // What it returns of its inputs (wait_tensor, views) was not made here:
  // a tensor from outside the region is kept whatever the op.
  const std::vector<const c10::StorageImpl*> read = storages_in(inputs);
  for (const c10::IValue& out : outputs) {
    for_each_tensor(out, [&](const at::Tensor& t) {
      if (t.defined() && t.has_storage() && !storages_.find(t).valid() &&
          std::find(read.begin(), read.end(), t.storage().unsafeGetStorageImpl()) == read.end()) {
        note(t.storage());
      }
    });
  }
  for (StorageId s : written) {
    if (c10::intrusive_ptr<c10::StorageImpl> alive = storages_[s].identity.lock()) {
      note(c10::Storage(std::move(alive)));
    }
  }
  OpInfo& info = tape_.ops[op_index];
  if (info.kept_why.empty()) {
    info.kept_why = why != nullptr ? std::string(why) : unrecordable_reason(facts, inputs, outputs);
  }
}

void Region::count_kept_anyway(const at::Tensor& t) {
  if (unreplayable_by_.empty() || !t.defined() || !t.has_storage()) {
    return;
  }
  auto it = unreplayable_by_.find(t.storage().unsafeGetStorageImpl());
  if (it == unreplayable_by_.end()) {
    return;
  }
  if (it->second.storage.expired()) { // freed, and the address reused
    unreplayable_by_.erase(it);
    return;
  }
  OpInfo& info = tape_.ops[it->second.op_index];
  ++info.kept_anyway;
  if (!it->second.counted) {
    it->second.counted = true;
    info.kept_anyway_bytes += static_cast<int64_t>(t.storage().nbytes());
  }
}

void Region::observe_inputs(c10::ArrayRef<c10::IValue> inputs) {
  for (const c10::IValue& v : inputs) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (t.defined() && t.has_storage()) {
        const StorageId s = storages_.find(t);
        if (s.valid()) {
          storages_.observe(s, t);
        }
      }
    });
  }
}

Region::Writes Region::prepare_writes(
    const OpFacts& facts,
    c10::ArrayRef<c10::IValue> inputs,
    bool recordable) {
  // Tensors this op overwrites that replay cannot rebuild (from outside the
  // region, or kept by the policy): a replay gets a copy of their value from
  // before the op instead, so BatchNorm's running statistics are updated
  // exactly once. Only an op that makes new tensors or writes a replayable
  // storage can be replayed; others need no copy.
  Writes writes;
  writes.overwritten.resize(inputs.size());
  if (offload::active()) {
    // A host copy of a storage about to be written must hold the value
    // before the write (offloader.h).
    for (size_t i : facts.written_args) {
      for_each_tensor(inputs[i], [&](const at::Tensor& t) {
        if (t.defined() && t.has_storage()) {
          offload::before_write(t.storage().unsafeGetStorageImpl());
        }
      });
    }
  }
  std::vector<size_t> unreplayable; // argument positions
  writes.may_replay = recordable && facts.makes_new_tensors;
  for (size_t i : facts.written_args) {
    if (inputs[i].isTensorList() || inputs[i].isList()) {
      for_each_tensor(inputs[i], [&](const at::Tensor& t) {
        const StorageId s = storages_.find(t);
        if (s.valid()) {
          writes.storages.push_back(s);
        }
        if (t.defined() && t.has_storage() && tape_.holds_tensors()) {
          // FSDP2's copies preserve the version counter: without this, an
          // earlier reader's replay would read the new value unnoticed.
          stats_.held_bytes += tape_.preserve_held_before_write(t);
        }
      });
      continue;
    }
    if (!inputs[i].isTensor() || !inputs[i].toTensor().defined() ||
        !inputs[i].toTensor().has_storage()) {
      continue;
    }
    const StorageId s = storages_.find(inputs[i].toTensor());
    if (s.valid()) {
      writes.storages.push_back(s);
      writes.may_replay = writes.may_replay || (recordable && storages_[s].replayable);
    }
    if (!s.valid() || !storages_[s].replayable) {
      unreplayable.push_back(i);
    }
  }
  if (writes.may_replay) {
    const ReplayGuard plain_copy; // no graph, no modes: the region's own copy
    for (size_t i : unreplayable) {
      writes.overwritten[i] = inputs[i].toTensor().clone();
    }
  }
  if (tape_.holds_tensors()) {
    for (size_t i : unreplayable) {
      stats_.held_bytes += tape_.preserve_held_before_write(inputs[i].toTensor());
    }
  }
  return writes;
}

int64_t Region::track_outputs(
    Entry& entry,
    EntryId index,
    c10::ArrayRef<c10::IValue> inputs,
    c10::ArrayRef<c10::IValue> outputs,
    bool save) {
  bool produced = false;
  int32_t output_position = 0;
  int64_t new_bytes = 0;
  for (const c10::IValue& out : outputs) {
    for_each_tensor(out, [&](const at::Tensor& t) {
      const int32_t position = output_position++;
      if (!t.defined() || !t.has_storage() || storages_.find(t).valid()) {
        return;
      }
      // A tensor from outside that the op merely returns is not produced here.
      for (const c10::IValue& in : inputs) {
        bool alias = false;
        for_each_tensor(in, [&](const at::Tensor& a) {
          alias = alias || (a.defined() && a.has_storage() && a.storage().is_alias_of(t.storage()));
        });
        if (alias) {
          return;
        }
      }
      entry.produced.emplace_back(position, storages_.track(t, index, position, !save));
      new_bytes += static_cast<int64_t>(t.storage().nbytes());
      produced = true;
    });
  }
  return produced ? new_bytes : -1;
}

void Region::check_must_offload(
    const OpFacts& facts,
    c10::ArrayRef<c10::IValue> inputs,
    c10::ArrayRef<c10::IValue> outputs,
    bool recordable) {
  const offload::OffloadOptions options = offload::options();
  const char* unrecordable = first_unrecordable(inputs);
  if (unrecordable == nullptr) {
    unrecordable = first_unrecordable(outputs);
  }
  TORCH_CHECK_VALUE(
      recordable && first_unrecordable(outputs) == nullptr,
      "torch_sac: the policy returned MUST_OFFLOAD for ", facts.name,
      ", but the region cannot record this op (",
      unrecordable != nullptr ? unrecordable : "a collective, or an op writing a list of tensors",
      "), so its outputs stay with autograd. Return PREFER_OFFLOAD or MUST_SAVE for this op.");
  for (const c10::IValue& out : outputs) {
    for_each_tensor(out, [&](const at::Tensor& t) {
      bool on_an_input = false;
      for (const c10::IValue& in : inputs) {
        for_each_tensor(in, [&](const at::Tensor& a) {
          on_an_input = on_an_input ||
              (t.has_storage() && a.defined() && a.has_storage() &&
               a.storage().is_alias_of(t.storage()));
        });
      }
      offload::check_must_offload(facts.name, t, facts.returns_alias || on_an_input, options);
    });
  }
}

void Region::count_decision(OpInfo& info, int64_t call_index, Policy decision, int64_t new_bytes) {
  if (is_offload(decision)) {
    ++stats_.offloaded_ops;
    stats_.offloaded_bytes += new_bytes;
    ++info.offloaded;
    info.offloaded_bytes += new_bytes;
  } else if (is_save(decision)) {
    ++stats_.saved_ops;
    stats_.saved_bytes += new_bytes;
    ++info.saved;
    info.saved_bytes += new_bytes;
    info.saved_calls.push_back(call_index);
  } else {
    ++stats_.dropped_ops;
    stats_.dropped_bytes += new_bytes;
    ++info.dropped;
    info.dropped_bytes += new_bytes;
  }
}

void Region::record_for_replay(
    Entry& entry,
    c10::ArrayRef<c10::IValue> inputs,
    const std::vector<c10::IValue>& overwritten,
    std::optional<RngSnapshot> rng) {
  for (size_t i = 0; i < overwritten.size(); ++i) {
    if (overwritten[i].isTensor()) {
      entry.scratch_args.push_back(static_cast<uint32_t>(i));
      stats_.held_bytes += static_cast<int64_t>(overwritten[i].toTensor().storage().nbytes());
    }
  }
  // Before the writes are recorded: the arguments refer to the state this
  // op saw.
  tape_.record_args(
      entry, inputs, overwritten, storages_, &stats_.held_offloaded, &stats_.offload_fallbacks);
  entry.rng = std::move(rng);
  entry.numerics = NumericsState::current();
}

void Region::handle(
    const c10::OperatorHandle& op,
    torch::jit::Stack* stack,
    RunOp run,
    const void* adapter_view) {
  // Ops under no_grad inside a region entered with grad on are recorded too:
  // a custom autograd.Function's forward and torch.no_grad() blocks make
  // tensors that backward may save, and that a replay may need.
  if (!records_ || c10::InferenceMode::is_enabled() || interception_paused()) {
    run(stack);
    return;
  }
  if (tls_collective_running == this) {
    // An op a c10d collective's backend runs: the storages it makes are
    // noted (not views: those are of the collective's own arguments).
    const std::vector<const c10::StorageImpl*> read = storages_in(
        torch::jit::last(*stack, op.schema().arguments().size()));
    run(stack);
    std::lock_guard<std::mutex> lock(mutex_);
    for (const c10::IValue& out : torch::jit::last(*stack, op.schema().returns().size())) {
      for_each_tensor(out, [&](const at::Tensor& t) {
        if (!t.defined() || !t.has_storage() || storages_.find(t).valid()) {
          return;
        }
        const c10::StorageImpl* made = t.storage().unsafeGetStorageImpl();
        if (std::find(read.begin(), read.end(), made) == read.end()) {
          backend_scratch_.insert_or_assign(made, t.storage().getWeakStorageImpl());
        }
      });
    }
    return;
  }
  using Clock = std::chrono::steady_clock;
  const auto record_start = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  int32_t op_index = 0;
  const OpFacts& facts = *tape_.info_for(op, &op_index).facts;
  if (!open_ || facts.ignored) {
    lock.unlock();
    run(stack);
    return;
  }
  const size_t num_args = facts.num_args;
  TORCH_INTERNAL_ASSERT(stack->size() >= num_args);
  if (passes_through(
          c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - num_args, num_args))) {
    // Not the region's: no entry, no policy call. The ops the subclass runs
    // come back here (InterceptNestedOps) and are recorded on plain tensors.
    lock.unlock();
    InterceptNestedOps nested;
    run(stack);
    return;
  }
  const std::vector<c10::IValue> inputs(stack->end() - num_args, stack->end());
  if (!backend_scratch_.empty() && finishes_backend_collective(inputs)) {
    lock.unlock();
    run(stack);
    return;
  }

  // 1. Before the op runs: what it reads and writes, and what a replay of
  // it will need that the op is about to change.
  const bool can_record = !unrecordable(facts, inputs);
  observe_inputs(inputs);
  Writes writes = prepare_writes(facts, inputs, can_record);
  // A call that draws nothing (attention with dropout_p == 0) needs no
  // snapshot: the same rule as the drop-in's (op_facts.h).
  std::optional<RngSnapshot> rng = writes.may_replay && call_draws_random(facts, inputs)
      ? RngSnapshot::capture(op, inputs)
      : std::nullopt;

  // 2. The op runs and the policy decides, without the mutex (a replay on
  // another thread may need it).
  const auto run_start = Clock::now();
  lock.unlock();
  if (facts.filled_buffer) {
    run_noting_backend_scratch(stack, run);
  } else {
    run(stack);
  }
  const auto run_end = Clock::now();
  const size_t num_returns = facts.num_returns;
  c10::ArrayRef<c10::IValue> outputs(stack->data() + stack->size() - num_returns, num_returns);
  if (passes_through(outputs)) {
    return; // a factory on the meta device
  }
  const int64_t call_index = tape_.ops[op_index].calls; // stable: only this thread records
  const Policy decision = decide(OpCall{op, inputs, outputs, call_index, adapter_view}, facts.name);
  if (decision == Policy::MustOffload) {
    check_must_offload(facts, inputs, outputs, can_record);
  }
  lock.lock();

  // 3. The entry: its outputs tracked, the decision counted, and what a
  // replay needs recorded when one may run it.
  OpInfo& info = tape_.ops[op_index];
  ++info.calls;
  ++stats_.policy_calls;
  const EntryId entry_index = tape_.entries.next_id();
  Entry entry{op, op_index, call_index};
  entry.scope = tape_.scope();
  if (facts.collective) {
    ++stats_.collective_ops;
    for (const c10::IValue& out : outputs) {
      for_each_tensor(out, [&](const at::Tensor& t) {
        if (t.defined() && t.has_storage()) {
          stats_.collective_bytes += static_cast<int64_t>(t.storage().nbytes());
        }
      });
    }
  }
  if (facts.collective_wait) {
    // The backend wrote the collective's output (bumping its version) on
    // its own thread, at a time of its own, until now.
    for (const c10::IValue& in : inputs) {
      for_each_tensor(in, [&](const at::Tensor& t) {
        const StorageId s = storages_.find(t);
        if (s.valid()) {
          storages_.settle(s, t);
        }
      });
    }
  }
  if (!can_record || first_unrecordable(outputs) != nullptr) {
    // Not replayable: its outputs stay untracked, and a storage it wrote can
    // no longer be rebuilt past this point.
    for (StorageId s : writes.storages) {
      storages_[s].replayable = false;
    }
    if (!is_kept(decision)) {
      note_unreplayable(op_index, facts, inputs, outputs, writes.storages);
    }
    tape_.entries.push_back(std::move(entry));
    return;
  }
  if (has_budget_) {
    // Only for entries a replay may run, whose tensors are all strided with
    // sizes (nested tensors have none for the FLOP formulas to read).
    entry.replay_cost = estimated_replay_cost(op, inputs, outputs);
  }
  const bool save = is_kept(decision);
  const int64_t new_bytes = track_outputs(entry, entry_index, inputs, outputs, save);
  const bool produced = new_bytes >= 0;
  if (produced) {
    count_decision(info, call_index, decision, new_bytes);
  }
  if (facts.collective) {
    for (const auto& [position, s] : entry.produced) {
      storages_.unsettle(s);
      if (facts.replayable_collective) {
        storages_[s].collective = entry_index;
      }
    }
  }
  // A c10d collective filling a buffer the region made: the buffer's next
  // state is the collective's output, replayed as a write into it.
  const StorageId buffer = facts.filled_buffer && !writes.storages.empty() &&
          !is_collective_output(writes.storages.front())
      ? writes.storages.front()
      : StorageId::invalid();
  if (buffer.valid()) {
    if (storages_[buffer].replayable) {
      count_decision(info, call_index, decision, storages_[buffer].nbytes);
      if (save) {
        storages_[buffer].replayable = false; // the policy keeps the output
      }
    }
    storages_.unsettle(buffer, /*on_sight=*/true);
  }
  if (is_offload(decision)) {
    for (const auto& [position, s] : entry.produced) {
      storages_[s].offload = true;
      storages_[s].must_offload = decision == Policy::MustOffload;
    }
  }
  bool writes_replayable = false;
  std::vector<StorageId> collective_outputs_written;
  for (StorageId s : writes.storages) {
    if (is_collective_output(s) && storages_[s].replayable) {
      // Replays of a collective happen once a pass (note_collective_deps):
      // a later state of its output is kept, not rebuilt.
      storages_[s].replayable = false;
      collective_outputs_written.push_back(s);
    }
    writes_replayable = writes_replayable || storages_[s].replayable;
  }
  if (!collective_outputs_written.empty() && !save) {
    note_unreplayable(
        op_index, facts, inputs, {}, collective_outputs_written,
        "it writes a collective's output, which a region replays once per pass and never "
        "rebuilds at a later state");
  }
  entry.replayable = (produced && !save) || writes_replayable;
  if (facts.replayable_collective) {
    collectives_.note(op, facts, call_index, inputs, entry.replayable);
  }
  if (entry.replayable) {
    record_for_replay(entry, inputs, writes.overwritten, std::move(rng));
    note_collective_deps(entry, entry_index, facts.replayable_collective, writes.storages);
  }
  for (StorageId s : writes.storages) {
    storages_[s].mutations.push_back(entry_index);
    storages_[s].recorded_write_pending = true;
  }
  if (buffer.valid() && entry.replayable) {
    storages_[buffer].collective = entry_index;
    storages_[buffer].collective_state = storages_[buffer].mutations.next_id();
  }
  entry.writes = std::move(writes.storages);
  tape_.entries.push_back(std::move(entry));
  const auto record_end = Clock::now();
  stats_.record_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                          (run_start - record_start) + (record_end - run_end))
                          .count();
}

void Region::run_noting_backend_scratch(torch::jit::Stack* stack, RunOp run) {
  const CollectiveRunning running(this);
  const InterceptNestedOps nested;
  run(stack);
}

bool Region::finishes_backend_collective(c10::ArrayRef<c10::IValue> inputs) const {
  bool scratch = false;
  bool other = false;
  for (const c10::IValue& v : inputs) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (!t.defined() || !t.has_storage()) {
        return;
      }
      auto it = backend_scratch_.find(t.storage().unsafeGetStorageImpl());
      if (it != backend_scratch_.end() && !it->second.expired()) {
        scratch = true;
        return;
      }
      const StorageId s = storages_.find(t);
      // A buffer a c10d collective filled, not met since (it settles then).
      const bool awaited = s.valid() && storages_[s].collective.valid() && storages_[s].unsettled &&
          storages_[s].settles_on_sight;
      other = other || !awaited;
    });
  }
  return scratch && !other;
}

bool Region::is_collective_output(StorageId storage) const {
  return storages_[storage].collective.valid();
}

void Region::note_collective_deps(
    const Entry& entry,
    EntryId index,
    bool collective,
    const std::vector<StorageId>& written) {
  // What its outputs' rebuilds may replay: what its rebuilt inputs' may,
  // and the entry itself if it is a collective. Tape order is kept sorted.
  std::vector<EntryId> deps;
  for (const ArgSlot& slot : entry.slots) {
    if (slot.held.defined() || slot.offloaded.defined() || !slot.storage.valid()) {
      continue;
    }
    const std::vector<EntryId>& more = storages_[slot.storage].collective_deps;
    if (more.empty()) {
      continue;
    }
    std::vector<EntryId> merged;
    merged.reserve(deps.size() + more.size());
    std::set_union(deps.begin(), deps.end(), more.begin(), more.end(), std::back_inserter(merged));
    deps = std::move(merged);
  }
  if (collective) {
    deps.push_back(index);
  }
  if (deps.empty()) {
    return;
  }
  for (const auto& [position, s] : entry.produced) {
    storages_[s].collective_deps = deps;
  }
  for (StorageId s : written) {
    std::vector<EntryId>& mine = storages_[s].collective_deps;
    std::vector<EntryId> merged;
    std::set_union(mine.begin(), mine.end(), deps.begin(), deps.end(), std::back_inserter(merged));
    mine = std::move(merged);
  }
}

namespace {

// A tensor the region never drops, kept as autograd would keep it. Built
// without the region's mutex: detaching a tensor subclass runs its
// __torch_dispatch__, whose ops come back to Region::handle.
SavedActivation keep(const at::Tensor& t) {
  SavedActivation saved;
  saved.kept = held_for_backward(t);
  saved.version = version_of(t);
  saved.version_counter = t.unsafeGetTensorImpl()->version_counter();
  return saved;
}

} // namespace

SavedActivation Region::pack(const at::Tensor& t) {
  if (const char* kind = t.defined() ? unrecordable_kind(t) : nullptr) {
    SavedActivation saved = keep(t);
    const int64_t bytes = t.has_storage() ? static_cast<int64_t>(t.storage().nbytes()) : 0;
    std::lock_guard<std::mutex> lock(mutex_);
    count_kept_anyway(t);
    ++stats_.packed_kept;
    ++stats_.kept_as_is;
    stats_.kept_as_is_bytes += bytes;
    auto& [count, total] = kept_as_is_[kind];
    ++count;
    total += bytes;
    return saved;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  return pack_locked(t);
}

std::map<std::string, std::pair<int64_t, int64_t>> Region::kept_as_is() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return kept_as_is_;
}

std::optional<SavedActivation> Region::try_pack(const at::Tensor& t) {
  if (t.defined() && unrecordable_kind(t) != nullptr) {
    return std::nullopt; // pack() keeps it without holding the mutex
  }
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock()) {
    return std::nullopt;
  }
  return pack_locked(t);
}

SavedActivation Region::pack_locked(const at::Tensor& t) {
  SavedActivation saved;
  const StorageId s = t.defined() && t.has_storage() ? storages_.find(t) : StorageId::invalid();
  if (s.valid()) {
    storages_.observe(s, t);
  }
  if (t.defined()) {
    saved.version = version_of(t);
    saved.version_counter = t.unsafeGetTensorImpl()->version_counter();
  }
  if (s.valid() && storages_[s].offload) {
    const StorageRecord& record = storages_[s];
    if (offload::why_not_offloadable(t, offload::options(), record.must_offload) == nullptr) {
      saved.offloaded = offload::offload(
          t, record.mutations.next_id().index(),
          tape_.ops[tape_.entries[record.producer].op_index].facts->name);
      ++stats_.packed_offloaded;
      return saved;
    }
    ++stats_.offload_fallbacks; // PREFER_OFFLOAD: kept on the device
  }
  if (!s.valid() || !storages_[s].replayable) {
    saved.kept = held_for_backward(t);
    ++stats_.packed_kept;
    count_kept_anyway(t);
    return saved;
  }
  const std::vector<EntryId>& collectives = storages_[s].collective_deps;
  if (!collectives.empty()) {
    collectives_.note_dependent_pack(
        stats_.packed_kept + stats_.packed_dropped + stats_.packed_offloaded, collectives);
  }
  saved.region = shared_from_this();
  saved.storage = s;
  saved.state = storages_[s].mutations.next_id();
  saved.geometry = TensorGeometry::of(t);
  saved.original = c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr());
  saved.horizon = static_cast<int32_t>(tape_.entries.size());
  saved.scope = tape_.scope();
  storages_.add_reference(s, saved.horizon);
  ++stats_.packed_dropped;
  return saved;
}

void Region::forget(const SavedActivation& saved) {
  if (replaying_on_this_thread()) {
    forget_after_replay(saved);
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  forget_locked(saved.storage, saved.unpacked_pass, saved.horizon);
}

bool Region::try_forget(SavedActivation& saved) {
  if (replaying_on_this_thread()) {
    forget_after_replay(saved);
  } else {
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock()) {
      return false;
    }
    forget_locked(saved.storage, saved.unpacked_pass, saved.horizon);
  }
  saved.region.reset(); // forgotten: its destructor has nothing left to do
  return true;
}

void Region::forget_locked(StorageId storage, int64_t unpacked_pass, int32_t horizon) {
  storages_.drop_reference(storage, unpacked_pass, horizon);
  release_unneeded_entries();
}

bool Region::replaying_on_this_thread() const {
  return replaying_thread_.load(std::memory_order_relaxed) == std::this_thread::get_id();
}

void Region::forget_after_replay(const SavedActivation& saved) {
  // This thread holds mutex_ (its rebuild is running this code).
  deferred_forgets_.push_back({saved.storage, saved.unpacked_pass, saved.horizon});
}

void Region::forget_deferred() {
  if (deferred_forgets_.empty()) {
    return;
  }
  for (const DeferredForget& f : std::exchange(deferred_forgets_, {})) {
    storages_.drop_reference(f.storage, f.unpacked_pass, f.horizon);
  }
  release_unneeded_entries();
}

SavedActivation::~SavedActivation() {
  if (region) {
    region->forget(*this);
  }
}

RegionStats Region::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  RegionStats stats = stats_;
  stats.memo_bytes = storages_.strong_memo_bytes();
  return stats;
}

std::vector<std::pair<std::string, int64_t>> Region::saved_calls() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<std::string, int64_t>> calls;
  for (const OpInfo& info : tape_.ops) {
    for (int64_t call : info.saved_calls) {
      calls.emplace_back(info.facts->name, call);
    }
  }
  return calls;
}

std::vector<RegionOpSummary> Region::op_summary() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<RegionOpSummary> rows;
  for (const OpInfo& info : tape_.ops) {
    if (!info.facts->ignored) {
      auto by_call = info.replays_by_call;
      by_call.resize(static_cast<size_t>(info.calls), 0);
      rows.push_back(
          {info.facts->name, info.saved, info.dropped, info.replayed, info.saved_bytes,
           info.dropped_bytes, info.replay_ns, std::move(by_call), info.offloaded,
           info.offloaded_bytes, info.kept_anyway, info.kept_anyway_bytes,
           info.kept_anyway > 0 ? info.kept_why : std::string()});
    }
  }
  return rows;
}

} // namespace torch_sac::region
