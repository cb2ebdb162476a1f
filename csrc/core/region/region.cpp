#include "csrc/core/region/region.h"

#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <chrono>

#include "csrc/core/detached_alias.h"
#include "csrc/core/ivalue_tensors.h"
#include "csrc/core/region/replay_cost.h"
#include "csrc/core/replay_guard.h"
#include "csrc/core/tensor_kind.h"
#include "csrc/core/tensor_version.h"

namespace torch_sac::region {
namespace {

// A device argument without an index means "the current device" (for CUDA,
// the one torch.cuda.set_device chose): pin it, so a replay on a backward
// thread with another current device makes the tensor where forward did.
c10::IValue with_current_index(const c10::IValue& v) {
  const c10::Device device = v.toDevice();
  if (device.has_index() || device.is_cpu() || device.is_meta()) {
    return v;
  }
  return c10::Device(
      device.type(), c10::impl::getDeviceGuardImpl(device.type())->getDevice().index());
}

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

} // namespace

Region::Region(
    std::shared_ptr<OpPolicy> policy,
    bool allow_cache_entry_mutation,
    int64_t replay_budget,
    bool budget_counts_saved,
    double checkpoint_share)
    : allow_cache_entry_mutation_(allow_cache_entry_mutation),
      replay_budget_(replay_budget),
      budget_counts_saved_(budget_counts_saved),
      checkpoint_share_(checkpoint_share),
      records_(!recording_disabled()) {
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
  scope_parents_.push_back(scope_);
  scope_ = ScopeId::at(scope_parents_.size() - 1);
}

void Region::pop_policy() {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(policies_.size() > 1, "torch_sac: pop_policy without a nested region");
  policies_.pop_back();
  scope_ = scope_parents_[scope_];
}

void Region::close() {
  // Policies are only asked in forward. Letting go of them here breaks
  // reference cycles through Python policies (a module whose bound method
  // is the policy and which keeps its region); they are destroyed after the
  // mutex is released, since a Python one takes the GIL to die.
  std::vector<std::shared_ptr<OpPolicy>> policies;
  std::lock_guard<std::mutex> lock(mutex_);
  open_ = false;
  policies.swap(policies_);
  release_unneeded_entries();
}

void Region::release_unneeded_entries() {
  if (open_) {
    return;
  }
  if (live_dropped_ == 0) {
    // Nothing can replay: the tape goes; the stats and op summary stay.
    entries_.clear();
    entries_.shrink_to_fit();
    storages_.clear();
    storages_.shrink_to_fit();
    storage_index_.clear();
    held_slots_.clear();
    memoised_.clear();
    released_from_ = 0;
    return;
  }
  const size_t needed = static_cast<size_t>(live_horizons_.rbegin()->first);
  for (size_t e = std::min(released_from_, entries_.size()); e > needed; --e) {
    Entry& entry = entries_[EntryId::at(e - 1)];
    entry.replayable = false;
    entry.args = {};
    entry.slots = {};
    entry.rng.reset();
  }
  released_from_ = std::min(released_from_, needed);
}

Region::OpInfo& Region::info_for(const c10::OperatorHandle& op, int32_t* index) {
  auto [it, inserted] = op_index_.try_emplace(op, static_cast<int32_t>(ops_.size()));
  if (inserted) {
    OpInfo info;
    info.facts = op_facts(op);
    ops_.push_back(std::move(info));
  }
  *index = it->second;
  return ops_[it->second];
}

Policy Region::decide(const OpCall& call, const std::string& op_name) {
  Policy decision = policies_.front()->decide(call);
  for (size_t i = 1; i < policies_.size(); ++i) {
    decision = combine_policies(decision, policies_[i]->decide(call), op_name);
  }
  return decision;
}

StorageId Region::find_storage(const at::Tensor& t) const {
  if (!t.defined() || !t.has_storage()) {
    return StorageId::invalid();
  }
  auto it = storage_index_.find(t.storage().unsafeGetStorageImpl());
  return it == storage_index_.end() ? StorageId::invalid() : it->second;
}

StorageId Region::track_storage(
    const at::Tensor& t,
    EntryId producer,
    int32_t output,
    bool replayable) {
  const auto& storage = t.storage();
  StorageRecord record{
      c10::weak_intrusive_ptr<c10::StorageImpl>(storage.getWeakStorageImpl()),
      t.unsafeGetTensorImpl()->version_counter()};
  record.producer = producer;
  record.producer_output = output;
  record.replayable = replayable;
  record.last_version = version_of(t);
  record.nbytes = static_cast<int64_t>(storage.nbytes());
  const StorageId index = storages_.next_id();
  storages_.push_back(std::move(record));
  storage_index_[storage.unsafeGetStorageImpl()] = index;
  return index;
}

// A write the tape did not see (under no_grad) changes the version without
// changing the recorded state: replaying would miss it, so the storage is no
// longer dropped. (A write through `.data` bumps another version counter and
// cannot be seen here, as autograd cannot see it either.)
void Region::observe(StorageId storage, const at::Tensor& t) {
  StorageRecord& record = storages_[storage];
  const uint32_t version = version_of(t);
  const bool expected = version == record.last_version ||
      (record.recorded_write_pending && version == record.last_version + 1);
  if (!expected) {
    record.replayable = false;
  }
  record.last_version = version;
  record.recorded_write_pending = false;
}

void Region::record_args(
    Entry& entry,
    c10::ArrayRef<c10::IValue> inputs,
    const std::vector<c10::IValue>& overwritten) {
  // Records a slot for `t` and returns the placeholder left in the argument.
  auto slot_for = [&](const at::Tensor& t, size_t arg, int32_t element) {
    if (!t.defined()) {
      return t;
    }
    ArgSlot slot;
    slot.arg = static_cast<uint32_t>(arg);
    slot.element = element;
    const StorageId storage = find_storage(t);
    if (storage.valid() && storages_[storage].replayable) {
      StorageRecord& record = storages_[storage];
      if (scope_ != entries_[record.producer].scope &&
          std::find(record.reader_scopes.begin(), record.reader_scopes.end(), scope_) ==
              record.reader_scopes.end()) {
        record.reader_scopes.push_back(scope_);
      }
      slot.storage = storage;
      slot.state = storages_[storage].mutations.next_id();
      slot.geometry = TensorGeometry::of(t);
    } else {
      slot.held = detached_alias(t);
      slot.version = version_of(t);
      if (t.has_storage()) {
        held_slots_[t.storage().unsafeGetStorageImpl()].emplace_back(
            entries_.next_id(), static_cast<int32_t>(entry.slots.size()));
      }
    }
    entry.slots.push_back(std::move(slot));
    return at::Tensor();
  };
  entry.args.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const c10::IValue& v = inputs[i];
    if (!overwritten[i].isNone()) {
      entry.args.push_back(overwritten[i]);
    } else if (v.isTensor()) {
      entry.args.push_back(slot_for(v.toTensor(), i, -1));
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      int32_t k = 0;
      for (const at::Tensor& t : v.toTensorList()) {
        list.push_back(slot_for(t, i, k++));
      }
      entry.args.push_back(std::move(list));
    } else if (v.isList()) { // Tensor?[] (index, index_put) and non-tensor lists
      c10::impl::GenericList list(v.toList().elementType());
      int32_t k = 0;
      for (const c10::IValue& e : v.toListRef()) {
        list.push_back(e.isTensor() ? c10::IValue(slot_for(e.toTensor(), i, k)) : e);
        ++k;
      }
      entry.args.push_back(std::move(list));
    } else if (v.isDevice()) {
      entry.args.push_back(with_current_index(v));
    } else {
      entry.args.push_back(v);
    }
  }
}

void Region::preserve_held_before_write(const at::Tensor& t) {
  auto it = held_slots_.find(t.storage().unsafeGetStorageImpl());
  if (it == held_slots_.end()) {
    return;
  }
  // Plain autograd never needs the old value (it would have saved it, and
  // then fail its version check): only a replay of an earlier reader does.
  at::Tensor copy;
  for (const auto& [e, k] : it->second) {
    if (e.index() >= entries_.size() || static_cast<size_t>(k) >= entries_[e].slots.size()) {
      continue; // released
    }
    ArgSlot& slot = entries_[e].slots[k];
    if (!slot.held.defined() || !slot.held.storage().is_alias_of(t.storage()) ||
        version_of(slot.held) != slot.version) {
      continue;
    }
    if (!copy.defined()) {
      const ReplayGuard plain_copy;
      const auto nbytes = static_cast<int64_t>(t.storage().nbytes());
      copy =
          at::empty({0}, t.options().dtype(at::kByte)).set_(t.storage(), 0, {nbytes}, {1}).clone();
      stats_.held_bytes += nbytes;
    }
    slot.held = TensorGeometry::of(slot.held).view_of(copy.storage());
    slot.version = version_of(slot.held);
  }
  held_slots_.erase(it);
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
  using Clock = std::chrono::steady_clock;
  const auto record_start = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  int32_t op_index = 0;
  OpInfo& info = info_for(op, &op_index);
  const OpFacts& facts = *info.facts;
  if (!open_ || facts.ignored) {
    lock.unlock();
    run(stack);
    return;
  }
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  TORCH_INTERNAL_ASSERT(stack->size() >= num_args);
  const std::vector<c10::IValue> inputs(stack->end() - num_args, stack->end());
  // An op on a kind of tensor the region cannot replay (quantized, nested,
  // sparse, subclasses) runs as if outside the region: its outputs are not
  // tracked, so autograd keeps them. Nothing here may throw: such ops also
  // run inside autograd's own bookkeeping, where an exception aborts.
  // Collectives are never replayed (a replay on one rank would desync the
  // others), and an op writing a list of tensors (`_foreach_*_`, FSDP's
  // split copies) is not tracked write by write: both run as if outside.
  bool writes_list = false;
  for (size_t i : facts.written_args) {
    writes_list = writes_list || inputs[i].isTensorList() || inputs[i].isList();
  }
  const bool recordable = !facts.collective && !writes_list &&
      first_unrecordable(inputs) == nullptr;
  for (const c10::IValue& v : inputs) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (t.defined() && t.has_storage()) {
        const StorageId s = find_storage(t);
        if (s.valid()) {
          observe(s, t);
        }
      }
    });
  }
  // Tensors this op overwrites that replay cannot rebuild (from outside the
  // region, or kept by the policy): a replay gets a copy of their value from
  // before the op instead, so BatchNorm's running statistics are updated
  // exactly once. Only an op that makes new tensors or writes a replayable
  // storage can be replayed; others need no copy.
  std::vector<c10::IValue> overwritten(num_args);
  std::vector<StorageId> written_storages;
  std::vector<size_t> written_unreplayable; // argument positions
  bool may_replay = recordable && facts.makes_new_tensors;
  for (size_t i : facts.written_args) {
    if (inputs[i].isTensorList() || inputs[i].isList()) {
      for_each_tensor(inputs[i], [&](const at::Tensor& t) {
        const StorageId s = find_storage(t);
        if (s.valid()) {
          written_storages.push_back(s);
        }
        if (t.defined() && t.has_storage() && !held_slots_.empty()) {
          // FSDP2's copies preserve the version counter: without this, an
          // earlier reader's replay would read the new value unnoticed.
          preserve_held_before_write(t);
        }
      });
      continue;
    }
    if (!inputs[i].isTensor() || !inputs[i].toTensor().defined() ||
        !inputs[i].toTensor().has_storage()) {
      continue;
    }
    const StorageId s = find_storage(inputs[i].toTensor());
    if (s.valid()) {
      written_storages.push_back(s);
      may_replay = may_replay || (recordable && storages_[s].replayable);
    }
    if (!s.valid() || !storages_[s].replayable) {
      written_unreplayable.push_back(i);
    }
  }
  if (may_replay) {
    const ReplayGuard plain_copy; // no graph, no modes: the region's own copy
    for (size_t i : written_unreplayable) {
      overwritten[i] = inputs[i].toTensor().clone();
    }
  }
  if (!held_slots_.empty()) {
    for (size_t i : written_unreplayable) {
      preserve_held_before_write(inputs[i].toTensor());
    }
  }
  // A call that draws nothing (attention with dropout_p == 0) needs no
  // snapshot: the same rule as the drop-in's (op_facts.h).
  std::optional<RngSnapshot> rng = may_replay && call_draws_random(facts, inputs)
      ? RngSnapshot::capture(op, inputs)
      : std::nullopt;
  const std::string& op_name = facts.name;

  const auto run_start = Clock::now();
  lock.unlock();
  run(stack);
  const auto run_end = Clock::now();
  const size_t num_returns = schema.returns().size();
  c10::ArrayRef<c10::IValue> outputs(stack->data() + stack->size() - num_returns, num_returns);
  const int64_t call_index = ops_[op_index].calls; // stable: only this thread records
  const Policy decision = decide(OpCall{op, inputs, outputs, call_index, adapter_view}, op_name);
  lock.lock();

  OpInfo& op_info = ops_[op_index];
  ++op_info.calls;
  ++stats_.policy_calls;
  const EntryId entry_index = entries_.next_id();
  Entry entry{op, op_index, call_index};
  entry.scope = scope_;
  if (!recordable || first_unrecordable(outputs) != nullptr) {
    // Not replayable: its outputs stay untracked, and a storage it wrote can
    // no longer be rebuilt past this point.
    for (StorageId s : written_storages) {
      storages_[s].replayable = false;
    }
    entries_.push_back(std::move(entry));
    return;
  }
  if (replay_budget_ != kNoReplayBudget) {
    // Only for entries a replay may run, whose tensors are all strided with
    // sizes (nested tensors have none for the FLOP formulas to read).
    entry.replay_cost = estimated_replay_cost(op, inputs, outputs);
  }
  const bool save = is_save(decision);

  bool produced = false;
  int32_t output_position = 0;
  int64_t new_bytes = 0;
  for (const c10::IValue& out : outputs) {
    for_each_tensor(out, [&](const at::Tensor& t) {
      const int32_t position = output_position++;
      if (!t.defined() || !t.has_storage() || find_storage(t).valid()) {
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
      entry.produced.emplace_back(position, track_storage(t, entry_index, position, !save));
      new_bytes += static_cast<int64_t>(t.storage().nbytes());
      produced = true;
    });
  }
  bool writes_replayable = false;
  for (StorageId s : written_storages) {
    writes_replayable = writes_replayable || storages_[s].replayable;
  }
  if (produced) {
    if (save) {
      ++stats_.saved_ops;
      stats_.saved_bytes += new_bytes;
      ++op_info.saved;
      op_info.saved_bytes += new_bytes;
      op_info.saved_calls.push_back(call_index);
    } else {
      ++stats_.dropped_ops;
      stats_.dropped_bytes += new_bytes;
      ++op_info.dropped;
      op_info.dropped_bytes += new_bytes;
    }
  }
  entry.replayable = (produced && !save) || writes_replayable;
  if (entry.replayable) {
    for (size_t i = 0; i < overwritten.size(); ++i) {
      if (overwritten[i].isTensor()) {
        entry.scratch_args.push_back(static_cast<uint32_t>(i));
        stats_.held_bytes += static_cast<int64_t>(overwritten[i].toTensor().storage().nbytes());
      }
    }
    // Before the writes below: the arguments refer to the state this op saw.
    record_args(entry, inputs, overwritten);
    entry.rng = std::move(rng);
    entry.numerics = NumericsState::current();
  }
  for (StorageId s : written_storages) {
    storages_[s].mutations.push_back(entry_index);
    storages_[s].recorded_write_pending = true;
  }
  entry.writes = std::move(written_storages);
  entries_.push_back(std::move(entry));
  const auto record_end = Clock::now();
  stats_.record_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                          (run_start - record_start) + (record_end - run_end))
                          .count();
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
  if (t.defined() && unrecordable_kind(t) != nullptr) {
    SavedActivation saved = keep(t);
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.packed_kept;
    return saved;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  return pack_locked(t);
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
  const StorageId s = t.defined() && t.has_storage() ? find_storage(t) : StorageId::invalid();
  if (s.valid()) {
    observe(s, t);
  }
  if (t.defined()) {
    saved.version = version_of(t);
    saved.version_counter = t.unsafeGetTensorImpl()->version_counter();
  }
  if (!s.valid() || !storages_[s].replayable) {
    saved.kept = held_for_backward(t);
    ++stats_.packed_kept;
    return saved;
  }
  StorageRecord& record = storages_[s];
  saved.region = shared_from_this();
  saved.storage = s;
  saved.state = record.mutations.next_id();
  saved.geometry = TensorGeometry::of(t);
  saved.original = c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr());
  ++record.pending_unpacks;
  ++record.live_refs;
  ++live_dropped_;
  saved.horizon = static_cast<int32_t>(entries_.size());
  saved.scope = scope_;
  ++live_horizons_[saved.horizon];
  ++stats_.packed_dropped;
  return saved;
}

void Region::forget(const SavedActivation& saved) {
  std::lock_guard<std::mutex> lock(mutex_);
  forget_locked(saved);
}

bool Region::try_forget(SavedActivation& saved) {
  std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
  if (!lock.owns_lock()) {
    return false;
  }
  forget_locked(saved);
  lock.unlock();
  saved.region.reset(); // forgotten: its destructor has nothing left to do
  return true;
}

void Region::forget_locked(const SavedActivation& saved) {
  StorageRecord& record = storages_.at(saved.storage);
  --record.live_refs;
  if (saved.unpacked_pass != pass_) {
    --record.pending_unpacks;
  }
  release_memos();
  --live_dropped_;
  auto horizon = live_horizons_.find(saved.horizon);
  if (--horizon->second == 0) {
    live_horizons_.erase(horizon);
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
  stats.memo_bytes = strong_memo_bytes();
  return stats;
}

std::vector<std::pair<std::string, int64_t>> Region::saved_calls() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<std::string, int64_t>> calls;
  for (const OpInfo& info : ops_) {
    for (int64_t call : info.saved_calls) {
      calls.emplace_back(info.facts->name, call);
    }
  }
  return calls;
}

std::vector<RegionOpSummary> Region::op_summary() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<RegionOpSummary> rows;
  for (const OpInfo& info : ops_) {
    if (!info.facts->ignored) {
      auto by_call = info.replays_by_call;
      by_call.resize(static_cast<size_t>(info.calls), 0);
      rows.push_back(
          {info.facts->name, info.saved, info.dropped, info.replayed, info.saved_bytes,
           info.dropped_bytes, info.replay_ns, std::move(by_call)});
    }
  }
  return rows;
}

} // namespace torch_sac::region
