#include "csrc/core/region/tape.h"

#include <ATen/ops/empty.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>

#include "csrc/core/detached_alias.h"
#include "csrc/core/region/storage_table.h"
#include "csrc/core/replay_guard.h"
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

} // namespace

OpInfo& Tape::info_for(const c10::OperatorHandle& op, int32_t* index) {
  auto [it, inserted] = op_index_.try_emplace(op, static_cast<int32_t>(ops.size()));
  if (inserted) {
    OpInfo info;
    info.facts = op_facts(op);
    ops.push_back(std::move(info));
  }
  *index = it->second;
  return ops[it->second];
}

void Tape::push_scope() {
  scope_parents_.push_back(scope_);
  scope_ = ScopeId::at(scope_parents_.size() - 1);
}

void Tape::pop_scope() {
  scope_ = scope_parents_[scope_];
}

bool Tape::encloses(ScopeId outer, ScopeId inner) const {
  for (ScopeId s = inner; s.valid(); s = scope_parents_[s]) {
    if (s == outer) {
      return true;
    }
  }
  return false;
}

void Tape::record_args(
    Entry& entry,
    c10::ArrayRef<c10::IValue> inputs,
    const std::vector<c10::IValue>& overwritten,
    StorageTable& storages,
    int64_t* offloads,
    int64_t* fallbacks) {
  // Records a slot for `t` and returns the placeholder left in the argument.
  auto slot_for = [&](const at::Tensor& t, size_t arg, int32_t element) {
    if (!t.defined()) {
      return t;
    }
    ArgSlot slot;
    slot.arg = static_cast<uint32_t>(arg);
    slot.element = element;
    const StorageId storage = storages.find(t);
    if (storage.valid() && storages[storage].replayable) {
      StorageRecord& record = storages[storage];
      if (scope_ != entries[record.producer].scope &&
          std::find(record.reader_scopes.begin(), record.reader_scopes.end(), scope_) ==
              record.reader_scopes.end()) {
        record.reader_scopes.push_back(scope_);
      }
      slot.storage = storage;
      slot.state = record.mutations.next_id();
      slot.geometry = TensorGeometry::of(t);
    } else {
      if (storage.valid() && storages[storage].offload) {
        const StorageRecord& record = storages[storage];
        const offload::OffloadOptions options = offload::options();
        if (offload::why_not_offloadable(t, options, record.must_offload) == nullptr) {
          slot.offloaded = offload::offload(
              t, record.mutations.next_id().index(),
              ops[entries[record.producer].op_index].facts->name);
          held_slots_[t.storage().unsafeGetStorageImpl()].emplace_back(
              entries.next_id(), static_cast<int32_t>(entry.slots.size()));
          ++*offloads;
          entry.slots.push_back(std::move(slot));
          return at::Tensor();
        }
        ++*fallbacks;
      }
      slot.held = detached_alias(t);
      slot.version = version_of(t);
      if (t.has_storage()) {
        held_slots_[t.storage().unsafeGetStorageImpl()].emplace_back(
            entries.next_id(), static_cast<int32_t>(entry.slots.size()));
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

int64_t Tape::preserve_held_before_write(const at::Tensor& t) {
  auto it = held_slots_.find(t.storage().unsafeGetStorageImpl());
  if (it == held_slots_.end()) {
    return 0;
  }
  // Plain autograd never needs the old value (it would have saved it, and
  // then fail its version check): only a replay of an earlier reader does.
  int64_t copied = 0;
  at::Tensor copy;
  for (const auto& [e, k] : it->second) {
    if (e.index() >= entries.size() || static_cast<size_t>(k) >= entries[e].slots.size()) {
      continue; // released
    }
    ArgSlot& slot = entries[e].slots[k];
    if (slot.offloaded.defined()) {
      // The host copy holds the value read (offload::before_write started or
      // waited for it), so the write needs no copy here.
      slot.preserved = slot.preserved || slot.offloaded.is_of(t.storage().unsafeGetStorageImpl());
      continue;
    }
    if (!slot.held.defined() || !slot.held.storage().is_alias_of(t.storage()) ||
        version_of(slot.held) != slot.version) {
      continue;
    }
    if (!copy.defined()) {
      const ReplayGuard plain_copy;
      const auto nbytes = static_cast<int64_t>(t.storage().nbytes());
      copy =
          at::empty({0}, t.options().dtype(at::kByte)).set_(t.storage(), 0, {nbytes}, {1}).clone();
      copied += nbytes;
    }
    slot.held = TensorGeometry::of(slot.held).view_of(copy.storage());
    slot.version = version_of(slot.held);
  }
  held_slots_.erase(it);
  return copied;
}

void Tape::release_from(size_t needed) {
  for (size_t e = std::min(released_from_, entries.size()); e > needed; --e) {
    Entry& entry = entries[EntryId::at(e - 1)];
    entry.replayable = false;
    entry.args = {};
    std::vector<ArgSlot>().swap(entry.slots);
    entry.rng.reset();
  }
  released_from_ = std::min(released_from_, needed);
}

void Tape::clear() {
  // `ops` stays: Region::handle holds a reference to an op's facts across
  // the unlocked run of the op, and the per-op counters outlive the tape.
  entries.clear();
  entries.shrink_to_fit();
  held_slots_.clear();
  released_from_ = 0;
}

} // namespace torch_sac::region
