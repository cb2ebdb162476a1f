#pragma once
// The tape: what a region recorded in forward, in order. One Entry per op
// call, with its arguments (each tensor replaced by an ArgSlot: a reference
// into a storage the region can replay, or a tensor it holds), its outputs'
// storages and what it wrote; one OpInfo per op overload; and the nested
// regions (scopes) the entries were recorded in.
//
// Part of Region (region.h), which owns it and guards it with its mutex.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "csrc/core/numerics_state.h"
#include "csrc/core/offload/offloader.h"
#include "csrc/core/op_facts.h"
#include "csrc/core/region/ids.h"
#include "csrc/core/region/rng_snapshot.h"
#include "csrc/core/tensor_geometry.h"

namespace torch_sac::region {

class StorageTable;

// A tensor argument of a replayable entry.
struct ArgSlot {
  uint32_t arg = 0;
  int32_t element = -1; // index in a list argument, -1 for a Tensor argument
  // Either a tensor the region holds (from outside or from a SAVE op) with
  // its version when used...
  at::Tensor held;
  uint32_t version = 0;
  // ...or its copy in host memory (a storage the policy offloaded), read
  // back when a replay needs it; `preserved`: a recorded write came after,
  // and the host copy holds the value read (no version check)...
  offload::OffloadedTensor offloaded;
  bool preserved = false;
  // ...or a reference into a storage the region can replay.
  StorageId storage; // invalid for a held tensor
  StateId state{0};
  TensorGeometry geometry;
};

struct Entry {
  c10::OperatorHandle op;
  int32_t op_index;       // into Tape::ops
  int64_t call_index = 0; // among the op's calls in the region
  bool replayable = false;
  std::vector<c10::IValue> args; // tensors filled in from slots on replay
  std::vector<ArgSlot> slots;
  std::vector<uint32_t> scratch_args;                  // copies of overwritten outside tensors
  std::vector<std::pair<int32_t, StorageId>> produced; // (output position, storage)
  std::vector<StorageId> writes;                       // region storages it wrote to
  std::optional<RngSnapshot> rng;
  NumericsState numerics; // default dtype etc. when recorded
  double replay_cost = 0; // estimated_replay_cost, when a budget weighs it
  ScopeId scope{0};       // the nested region it was recorded in
};

// One op overload in this region: what its schema says, shared with the
// drop-in and every region (op_facts.h), and this region's counts.
struct OpInfo {
  std::shared_ptr<const OpFacts> facts;
  int64_t calls = 0;
  int64_t saved = 0;
  int64_t dropped = 0;
  int64_t replayed = 0;
  int64_t saved_bytes = 0;
  int64_t dropped_bytes = 0;
  int64_t offloaded = 0; // calls whose new outputs the policy offloaded
  int64_t offloaded_bytes = 0;
  int64_t replay_ns = 0;
  int64_t kept_anyway = 0; // RegionOpSummary::kept_anyway, kept_anyway_bytes, kept_why
  int64_t kept_anyway_bytes = 0;
  std::string kept_why;
  std::vector<int64_t> replays_by_call;
  std::vector<int64_t> saved_calls; // call indices whose new outputs were kept
};

class Tape {
 public:
  // The op overload's info, added the first time it is met; `*index` is its
  // position in `ops`.
  OpInfo& info_for(const c10::OperatorHandle& op, int32_t* index);

  // Nested regions: each one entered opens a scope inside the current one.
  void push_scope();
  void pop_scope();
  ScopeId scope() const {
    return scope_;
  }
  bool nested() const {
    return scope_parents_.size() > 1;
  }
  bool encloses(ScopeId outer, ScopeId inner) const;

  // Fills `entry.args` and `entry.slots` from the op's `inputs` (`entry` is
  // about to be appended): `overwritten` replaces the inputs the op writes
  // that replay cannot rebuild. Records in `storages` which scopes read a
  // replayable storage. A held input of an OFFLOAD op's storage is offloaded
  // (`offloads`, `fallbacks`: counted).
  void record_args(
      Entry& entry,
      c10::ArrayRef<c10::IValue> inputs,
      const std::vector<c10::IValue>& overwritten,
      StorageTable& storages,
      int64_t* offloads,
      int64_t* fallbacks);
  // Whether some entry holds a tensor (preserve_held_before_write has work).
  bool holds_tensors() const {
    return !held_slots_.empty();
  }
  // `t` is about to be written by a recorded op: held arguments of earlier
  // entries that read its storage get a copy of the value they read.
  // Returns the bytes copied.
  int64_t preserve_held_before_write(const at::Tensor& t);

  // Entries from `needed` on can no longer be replayed: their arguments go.
  void release_from(size_t needed);
  // Nothing can replay any more: the entries go, the ops' counts stay.
  void clear();

  IdVector<EntryId, Entry> entries;
  std::vector<OpInfo> ops;

 private:
  std::unordered_map<c10::OperatorHandle, int32_t> op_index_;
  // Held arguments by the storage they hold: (entry, slot). The held alias
  // keeps the storage alive, so the address is not reused while listed.
  std::unordered_map<const c10::StorageImpl*, std::vector<std::pair<EntryId, int32_t>>> held_slots_;
  // Nested regions entered so far, by id (0: this region): each one's
  // enclosing scope (invalid for 0), and the one recording now.
  IdVector<ScopeId, ScopeId> scope_parents_{ScopeId::invalid()};
  ScopeId scope_{0};
  size_t released_from_ = SIZE_MAX; // entries from here on are released
};

} // namespace torch_sac::region
