#include "csrc/core/region/storage_table.h"

#include <c10/util/Exception.h>

#include "csrc/core/region/stream_sync.h"
#include "csrc/core/tensor_version.h"

namespace torch_sac::region {

StorageId StorageTable::find(const at::Tensor& t) const {
  if (!t.defined() || !t.has_storage()) {
    return StorageId::invalid();
  }
  auto it = index_.find(t.storage().unsafeGetStorageImpl());
  return it == index_.end() ? StorageId::invalid() : it->second;
}

StorageId StorageTable::track(
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
  const StorageId index = records_.next_id();
  records_.push_back(std::move(record));
  index_[storage.unsafeGetStorageImpl()] = index;
  return index;
}

// A write the tape did not see (under no_grad) changes the version without
// changing the recorded state: replaying would miss it, so the storage is no
// longer dropped. (A write through `.data` bumps another version counter and
// cannot be seen here, as autograd cannot see it either.)
void StorageTable::observe(StorageId storage, const at::Tensor& t) {
  StorageRecord& record = records_[storage];
  if (record.unsettled) {
    if (record.settles_on_sight) {
      settle(storage, t);
    }
    return;
  }
  const uint32_t version = version_of(t);
  const bool expected = version == record.last_version ||
      (record.recorded_write_pending && version == record.last_version + 1);
  if (!expected) {
    record.replayable = false;
  }
  record.last_version = version;
  record.recorded_write_pending = false;
}

void StorageTable::settle(StorageId storage, const at::Tensor& t) {
  StorageRecord& record = records_[storage];
  record.last_version = version_of(t);
  record.recorded_write_pending = false;
  record.unsettled = false;
  record.settles_on_sight = false;
}

// A rebuilt storage met on the way is kept when autograd will still unpack
// it at that state. Saved activations of a storage are all at its last
// state: one saved before a later in-place write fails the version check.
bool StorageTable::worth_memoising(StorageId storage, StateId state) const {
  const StorageRecord& record = records_[storage];
  return record.pending_unpacks > 0 && !record.memo.strong() && state == record.mutations.next_id();
}

void StorageTable::memoise(StorageId storage, const at::Tensor& t, StateId state) {
  StorageRecord& record = records_[storage];
  if (!record.memo.listed()) {
    memoised_.push_back(storage);
  }
  record.memo.hold(t.storage(), state, StreamStamp::current_for(t));
}

void StorageTable::release_memos() {
  size_t kept = 0;
  for (StorageId s : memoised_) {
    Memo& memo = records_[s].memo;
    if (records_[s].pending_unpacks <= 0 && !records_[s].pinned) {
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

void StorageTable::pin(StorageId storage, const at::Tensor& t) {
  StorageRecord& record = records_[storage];
  memoise(storage, t, record.collective_state);
  if (!record.pinned) {
    record.pinned = true;
    pinned_.push_back(storage);
  }
}

void StorageTable::pin_memo(StorageId storage) {
  StorageRecord& record = records_[storage];
  TORCH_INTERNAL_ASSERT(
      record.memo.strong(), "torch_sac: pinning a storage the region does not hold");
  if (!record.pinned) {
    record.pinned = true;
    pinned_.push_back(storage);
  }
}

void StorageTable::move_pin(StorageId from) {
  StorageRecord& record = records_[from];
  record.pin_moved = true;
  record.memo.clear(); // release_memos() forgets it
}

void StorageTable::unpin_from(EntryId horizon) {
  size_t kept = 0;
  for (StorageId s : pinned_) {
    StorageRecord& record = records_[s];
    // A collective's output is pinned once that collective replayed; a pin
    // moved to what its readers made, once they did.
    if ((record.collective.valid() ? record.collective : record.producer) < horizon) {
      pinned_[kept++] = s;
      continue;
    }
    record.pinned = false;
    record.pin_moved = false;
    record.memo.clear(); // not weakened: a weak copy would be liveness again
  }
  pinned_.resize(kept);
  release_memos();
}

void StorageTable::unpin_all() {
  for (StorageId s : pinned_) {
    records_[s].pinned = false;
    records_[s].pin_moved = false;
    records_[s].memo.clear();
  }
  pinned_.clear();
  release_memos();
}

int64_t StorageTable::strong_memo_bytes() const {
  int64_t bytes = 0;
  for (StorageId s : memoised_) {
    bytes += records_[s].memo.strong_bytes();
  }
  return bytes;
}

void StorageTable::add_reference(StorageId storage, int32_t horizon) {
  StorageRecord& record = records_[storage];
  ++record.pending_unpacks;
  ++record.live_refs;
  ++live_dropped_;
  ++live_horizons_[horizon];
}

void StorageTable::drop_reference(StorageId storage, int64_t unpacked_pass, int32_t horizon) {
  StorageRecord& record = records_.at(storage);
  --record.live_refs;
  if (unpacked_pass != pass_) {
    --record.pending_unpacks;
  }
  release_memos();
  --live_dropped_;
  auto live = live_horizons_.find(horizon);
  if (--live->second == 0) {
    live_horizons_.erase(live);
  }
}

void StorageTable::start_new_pass() {
  ++pass_;
  for (StorageRecord& record : records_) {
    record.pending_unpacks = record.live_refs;
  }
  for (StorageId s : memoised_) {
    records_[s].memo.clear();
  }
  memoised_.clear();
  for (StorageId s : pinned_) {
    records_[s].pinned = false;
    records_[s].pin_moved = false;
  }
  pinned_.clear();
}

void StorageTable::clear() {
  records_.clear();
  records_.shrink_to_fit();
  index_.clear();
  memoised_.clear();
  pinned_.clear();
}

} // namespace torch_sac::region
