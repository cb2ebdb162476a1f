#pragma once
// The storages a region tracks, and how long it keeps what it made of them.
//
// Every storage an op in the region allocates gets a StorageRecord: its
// producer entry, whether the region can replay it, the entries that wrote
// to it, the dropped activations (SavedActivation) that refer to it and the
// rebuilt copy it keeps for them (a Memo). Tensors are identified by
// storage: autograd wraps views in new TensorImpls, storages stay.
//
// Also the region's count of live dropped activations: their horizons (how
// much of the tape they may need) and the backward pass they belong to.
//
// Part of Region (region.h), which owns it and guards it with its mutex.

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <map>
#include <unordered_map>
#include <vector>

#include "csrc/core/region/ids.h"
#include "csrc/core/region/memo.h"

namespace torch_sac::region {

struct StorageRecord {
  // Pins the StorageImpl's address so the lookup key cannot be reused.
  c10::weak_intrusive_ptr<c10::StorageImpl> identity;
  c10::VariableVersion version_counter;
  int64_t nbytes = 0;
  EntryId producer;            // invalid: from outside the region
  int32_t producer_output = 0; // among the producer's output tensors
  bool replayable = false;     // produced by a RECOMPUTE op, never tainted
  // Produced by an OFFLOAD op: what autograd or a replay keeps of it goes
  // to host memory (csrc/core/offload/), MUST: or raises if it cannot.
  bool offload = false;
  bool must_offload = false;
  IdVector<StateId, EntryId> mutations; // [k]: the entry whose write made state k + 1
  // Last version seen, and whether a recorded write came after it: its
  // version bump happens above the interceptor, after the op returns (and
  // not at all for BatchNorm's running statistics), so the next sighting
  // may be one higher, but no more.
  uint32_t last_version = 0;
  bool recorded_write_pending = false;
  // A collective's output before its wait: its backend writes it (and bumps
  // its version) on a thread of its own, so versions mean nothing yet. A
  // c10d collective's is waited for outside the dispatcher (Work.wait()):
  // it settles when it is next met (`settles_on_sight`).
  bool unsettled = false;
  bool settles_on_sight = false;
  // Dropped activations of this storage alive, and those of them not yet
  // unpacked in this backward pass.
  int32_t live_refs = 0;
  int32_t pending_unpacks = 0;
  Memo memo; // a rebuilt copy
  // The collectives (replayable entries) a rebuild of it from scratch may
  // replay, in tape order.
  std::vector<EntryId> collective_deps;
  // The collective whose output it holds (its producer, or the c10d
  // collective that filled it) and the state that leaves it in; whether
  // that was replayed in this backward pass and is held at that state until
  // no live dropped activation can need it (pin()).
  EntryId collective;
  StateId collective_state{0};
  bool pinned = false;
  // Pinned, but the bytes held moved to what its readers made
  // (Region::move_pins_downstream): a collective's output still counts as
  // replayed in this pass, without being held.
  bool pin_moved = false;
  // Scopes other than the producer's whose entries read it (nested
  // regions only): a rebuild keeps it for those scopes' backward.
  std::vector<ScopeId> reader_scopes;
};

class StorageTable {
 public:
  StorageRecord& operator[](StorageId s) {
    return records_[s];
  }
  const StorageRecord& operator[](StorageId s) const {
    return records_[s];
  }
  const StorageRecord& at(StorageId s) const {
    return records_.at(s);
  }
  StorageRecord& at(StorageId s) {
    return records_.at(s);
  }
  const IdVector<StorageId, StorageRecord>& records() const {
    return records_;
  }

  // The record of `t`'s storage, or invalid when the region does not track it.
  StorageId find(const at::Tensor& t) const;
  // Tracks the storage of `t`, made by `producer` (its output `output`).
  StorageId track(const at::Tensor& t, EntryId producer, int32_t output, bool replayable);
  // `t`, of `storage`, is met again: a version change the tape did not
  // record makes the storage non-replayable.
  void observe(StorageId storage, const at::Tensor& t);

  // A collective's output: unsettled until settle(), when its wait returns
  // and its current version becomes the one to expect, or until it is met
  // again (`on_sight`).
  void unsettle(StorageId storage, bool on_sight = false) {
    records_[storage].unsettled = true;
    records_[storage].settles_on_sight = on_sight;
  }
  void settle(StorageId storage, const at::Tensor& t);

  // Rebuilt copies (memos). A rebuilt storage is worth keeping when
  // autograd will still unpack it at that state.
  bool worth_memoising(StorageId storage, StateId state) const;
  void memoise(StorageId storage, const at::Tensor& t, StateId state);
  // Weakens the memos nothing in this pass will unpack again; forgets the
  // weak ones whose storage died.
  void release_memos();
  int64_t strong_memo_bytes() const;
  // A replayed collective's output (at its collective_state): held, never
  // weakened nor let go by a budget, until unpin_from() or a new pass. Whether a later rebuild runs
  // the collective again must not depend on what is still alive (garbage
  // collection differs between ranks), or the ranks' replays fall out of
  // step (collective_agreement.h).
  void pin(StorageId storage, const at::Tensor& t);
  // Pins the strong memo `storage` holds, and lets go of what `from` holds
  // while it stays pinned (StorageRecord::pin_moved).
  void pin_memo(StorageId storage);
  void move_pin(StorageId from);
  const std::vector<StorageId>& pinned() const {
    return pinned_;
  }
  // Lets go of the pins of collectives at or past `horizon` in the tape (no
  // live dropped activation can replay them), or of all.
  void unpin_from(EntryId horizon);
  void unpin_all();
  // Storages holding a memo, strong or weak.
  const std::vector<StorageId>& memoised() const {
    return memoised_;
  }

  // Dropped activations: one of `storage` was packed, with `horizon`.
  void add_reference(StorageId storage, int32_t horizon);
  // One died; `unpacked_pass`: the pass it was last unpacked in.
  void drop_reference(StorageId storage, int64_t unpacked_pass, int32_t horizon);
  // One is unpacked for the first time in this pass.
  void mark_unpacked(StorageId storage) {
    --records_[storage].pending_unpacks;
  }
  bool any_live() const {
    return live_dropped_ > 0;
  }
  // The latest horizon among the live ones (any_live() must hold).
  int32_t latest_horizon() const {
    return live_horizons_.rbegin()->first;
  }
  // Backward passes through the region, from 0.
  int64_t pass() const {
    return pass_;
  }
  // An activation unpacked a second time: backward runs again
  // (retain_graph=True); every live one is pending again and the memos go.
  void start_new_pass();

  // Nothing can replay any more: every record goes.
  void clear();

 private:
  IdVector<StorageId, StorageRecord> records_;
  std::unordered_map<const c10::StorageImpl*, StorageId> index_;
  std::vector<StorageId> memoised_;
  std::vector<StorageId> pinned_;
  int64_t live_dropped_ = 0;                 // SavedActivations referring to the region
  int64_t pass_ = 0;                         // backward passes through the region, from 0
  std::map<int32_t, int32_t> live_horizons_; // horizon -> live dropped activations
};

} // namespace torch_sac::region
