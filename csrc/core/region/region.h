#pragma once
// The region engine behind `with torch_sac.sac_context(policy):`.
//
// Forward: every op the interceptor sees in the region becomes a tape entry
// (op, arguments with tensors replaced by references, policy outcome, RNG
// state). Tensors are identified by storage, not by TensorImpl, because
// autograd may wrap a view in a new TensorImpl. Autograd's saved tensors go
// through the region's saved-tensor hooks: pack keeps a tensor whose storage
// came from outside the region or from a SAVE op, and keeps only a reference
// (storage, mutation state, view geometry) to one from a RECOMPUTE op.
//
// Backward: unpacking a reference uses the original tensor if it is still
// alive and unchanged, and otherwise replays the recorded ops that rebuild
// its storage below autograd, with grad off and no Python involved.
//
// Memory: the region holds a tensor only when a replay may need it and it
// cannot be replayed itself (inputs from outside and outputs of SAVE ops used
// by RECOMPUTE ops), plus copies of tensors from outside the region that an
// op overwrote (BatchNorm's running statistics), so replay never writes to
// them again. Each holding ends as soon as no live saved activation can need
// it; rebuilt tensors are kept only for unpacks still to come (memo.h).
//
// Threads: recording is thread-local; pack, unpack and the end of a saved
// activation may come from any thread and take the region's mutex, which is
// never awaited while holding the GIL (see
// csrc/python/saved_activation_handle.h).

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "csrc/core/interceptor.h"
#include "csrc/core/numerics_state.h"
#include "csrc/core/op_facts.h"
#include "csrc/core/op_policy.h"
#include "csrc/core/region/ids.h"
#include "csrc/core/region/memo.h"
#include "csrc/core/region/replay_budget.h"
#include "csrc/core/region/replay_schedule.h"
#include "csrc/core/region/rng_snapshot.h"
#include "csrc/core/region/tensor_geometry.h"
#include "csrc/core/stats.h"

namespace torch_sac::region {

class Region;

// A saved tensor as autograd holds it while the region's hooks are active.
// Move-only: a dropped one tells its region when it dies, so the region
// knows which rebuilt copies and which parts of the tape are still needed.
struct SavedActivation {
  SavedActivation() = default;
  SavedActivation(SavedActivation&&) noexcept = default;
  SavedActivation& operator=(SavedActivation&&) noexcept = default;
  SavedActivation(const SavedActivation&) = delete;
  SavedActivation& operator=(const SavedActivation&) = delete;
  ~SavedActivation();

  // Kept: a detached alias of the tensor, checked against its version at
  // pack time on unpack (autograd skips its own check when hooks are used).
  at::Tensor kept;
  uint32_t version = 0;
  c10::VariableVersion version_counter; // of the packed tensor
  // Dropped: how to rebuild it.
  std::shared_ptr<Region> region;
  StorageId storage;
  StateId state{0};
  TensorGeometry geometry;
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> original;
  // The region's backward pass this one was last unpacked in.
  mutable int64_t unpacked_pass = -1;
  // Tape length when packed: a rebuild of it replays only earlier entries.
  int32_t horizon = 0;
  // The nested region that saved it (the op's, not the producer's scope).
  ScopeId scope{0};
  // The autograd graph task of its last unpack: reading it again in the
  // same backward (ctx.saved_tensors twice) is not a new backward pass.
  mutable int unpacked_task = -1;
};

class Region final : public OpHandler, public std::enable_shared_from_this<Region> {
 public:
  // No replay budget: every rebuilt tensor autograd will unpack later in
  // this backward is kept until then.
  static constexpr int64_t kNoReplayBudget = -1;
  // `budget_counts_saved`: the replay budget bounds rebuilt tensors plus the
  // outputs the policy kept in forward that are still alive, so the room a
  // kept checkpoint leaves when backward is past it goes to rebuilds (a
  // forward that keeps the first sweep of an optimal reversal; see
  // torch_sac/_peak_plan.py).
  // `checkpoint_share`: of what is free, the most the spaced heuristic
  // gives to checkpoints (replay_budget.h).
  Region(
      std::shared_ptr<OpPolicy> policy,
      bool allow_cache_entry_mutation,
      int64_t replay_budget = kNoReplayBudget,
      bool budget_counts_saved = false,
      double checkpoint_share = kDefaultCheckpointShare);

  // OpHandler: records the op (forward only, while open).
  void handle(
      const c10::OperatorHandle& op,
      torch::jit::Stack* stack,
      RunOp run,
      const void* adapter_view) override;

  // Nested regions stack their policies on the outermost region.
  void push_policy(std::shared_ptr<OpPolicy> policy);
  void pop_policy();
  // Stops recording; saved activations stay valid.
  void close();

  // The saved-tensor pack hook.
  SavedActivation pack(const at::Tensor& t);
  // pack(), or nothing when another thread holds the region (a replay):
  // lets a caller holding the GIL release it before waiting.
  std::optional<SavedActivation> try_pack(const at::Tensor& t);
  // Rebuilds a dropped activation (the unpack hook for references).
  at::Tensor rebuild(const SavedActivation& saved);
  // A dropped activation died (its autograd node was freed).
  void forget(const SavedActivation& saved);
  // forget() unless another thread holds the region; on success `saved` no
  // longer refers to the region.
  bool try_forget(SavedActivation& saved);

  RegionStats stats() const;
  std::vector<RegionOpSummary> op_summary() const;

  // Runs `schedule` in backward instead of choosing what each rebuild keeps
  // (replay_schedule.h). Not with a replay budget; set before backward.
  void set_replay_schedule(ReplaySchedule schedule);
  // The rebuilds of the current (or last) backward pass and what each kept.
  ReplaySchedule executed_schedule() const;
  // (op, call index) of every call whose new outputs the policy kept.
  std::vector<std::pair<std::string, int64_t>> saved_calls() const;

  // Brings back the storage of a tensor kept from forward that was freed
  // since (FSDP2 frees unsharded parameters after forward): `restore(t)`
  // returns whether it did; `done()` runs after the replay that needed it.
  // Called with the region's mutex held, from the thread running backward.
  struct StorageRestorer {
    std::function<bool(const at::Tensor&)> restore;
    std::function<void()> done;
  };
  void set_storage_restorer(StorageRestorer restorer);

 private:
  // tests/cpp/test_op_facts.cpp reads what the region recorded.
  friend struct RegionTestAccess;

  // A tensor argument of a replayable entry.
  struct ArgSlot {
    uint32_t arg = 0;
    int32_t element = -1; // index in a list argument, -1 for a Tensor argument
    // Either a tensor the region holds (from outside or from a SAVE op) with
    // its version when used...
    at::Tensor held;
    uint32_t version = 0;
    // ...or a reference into a storage the region can replay.
    StorageId storage; // invalid for a held tensor
    StateId state{0};
    TensorGeometry geometry;
  };

  struct Entry {
    c10::OperatorHandle op;
    int32_t op_index;       // into ops_
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
    ScopeId scope{0};       // the nested region it was recorded in (scope_parents_)
  };

  struct StorageRecord {
    // Pins the StorageImpl's address so the lookup key cannot be reused.
    c10::weak_intrusive_ptr<c10::StorageImpl> identity;
    c10::VariableVersion version_counter;
    int64_t nbytes = 0;
    EntryId producer;                     // invalid: from outside the region
    int32_t producer_output = 0;          // among the producer's output tensors
    bool replayable = false;              // produced by a RECOMPUTE op, never tainted
    IdVector<StateId, EntryId> mutations; // [k]: the entry whose write made state k + 1
    // Last version seen, and whether a recorded write came after it: its
    // version bump happens above the interceptor, after the op returns (and
    // not at all for BatchNorm's running statistics), so the next sighting
    // may be one higher, but no more.
    uint32_t last_version = 0;
    bool recorded_write_pending = false;
    // Dropped activations of this storage alive, and those of them not yet
    // unpacked in this backward pass.
    int32_t live_refs = 0;
    int32_t pending_unpacks = 0;
    Memo memo; // a rebuilt copy
    // Scopes other than the producer's whose entries read it (nested
    // regions only): a rebuild keeps it for those scopes' backward.
    std::vector<ScopeId> reader_scopes;
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
    int64_t replay_ns = 0;
    std::vector<int64_t> replays_by_call;
    std::vector<int64_t> saved_calls; // call indices whose new outputs were kept
  };

  // A rebuilt tensor's key by index into ops_ (op names are made when
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

  SavedActivation pack_locked(const at::Tensor& t);
  void forget_locked(const SavedActivation& saved);
  OpInfo& info_for(const c10::OperatorHandle& op, int32_t* index);
  Policy decide(const OpCall& call, const std::string& op_name);
  StorageId find_storage(const at::Tensor& t) const;
  StorageId track_storage(const at::Tensor& t, EntryId producer, int32_t output, bool replayable);
  void observe(StorageId storage, const at::Tensor& t);
  void record_args(
      Entry& entry,
      c10::ArrayRef<c10::IValue> inputs,
      const std::vector<c10::IValue>& overwritten);
  // `t` is about to be written by a recorded op: held arguments of earlier
  // entries that read its storage get a copy of the value they read.
  void preserve_held_before_write(const at::Tensor& t);

  // Replay (replay.cpp); called with mutex_ held.
  //
  // A rebuild replays, in tape order, exactly the entries the storage
  // depends on that no memo covers, and frees each intermediate after its
  // last use in that replay, as the forward did: peak memory stays that of
  // re-running the forward of the needed ops, and each entry runs once.
  struct ReplayPlan {
    std::vector<EntryId> entries;                  // sorted before running
    std::unordered_map<StorageId, StateId> states; // storage -> state to rebuild
    // Storages a memo covers (pinned for the replay), with their state.
    std::unordered_map<StorageId, std::pair<c10::Storage, StateId>> memos;
  };
  ReplayPlan plan_rebuild(StorageId storage, StateId state) const;
  // `scope`: of the saved activation it is for (nesting_allows).
  c10::Storage materialize(StorageId storage, StateId state, ScopeId scope);
  // A held argument must still be what the op read: same version, and its
  // storage not freed or shrunk since (FSDP2 frees unsharded parameters).
  void check_held(const ArgSlot& slot, const Entry& consumer);
  torch::jit::Stack replay_entry(
      EntryId entry_index,
      c10::function_ref<at::Tensor(const ArgSlot&)> resolve);
  bool worth_memoising(StorageId storage, StateId state) const;
  // The storages `plan` rebuilds that autograd will unpack later, other
  // than `target`, in the order the plan makes them.
  std::vector<StorageId> memo_candidates(const ReplayPlan& plan, StorageId target) const;
  // Which candidates this rebuild may keep: the schedule's step, the replay
  // budget's choice (replay_budget.h), or all of them (nullopt). Counts the
  // rebuild and records it in executed_.
  std::optional<std::unordered_set<StorageId>> memos_allowed(
      const ReplayPlan& plan,
      StorageId target,
      ScopeId scope);
  // Nested regions drop their own tensors again, as nested checkpoints do:
  // a rebuild for a tensor saved in scope T keeps a candidate only if it was
  // made or read in T or a scope enclosing T. The others (a nested region's
  // internals met on the way) are rebuilt when that region's backward
  // unpacks them: multiple recomputation of the inner ops.
  bool nesting_allows(StorageId candidate, ScopeId scope) const;
  bool encloses(ScopeId outer, ScopeId inner) const;
  std::unordered_set<StorageId> memos_within_budget(
      const ReplayPlan& plan,
      StorageId target,
      const std::vector<StorageId>& candidates);
  std::unordered_set<StorageId> memos_scheduled(
      StorageId target,
      const std::vector<StorageId>& candidates,
      size_t rebuild) const;
  ExecutedKey executed_key_of(StorageId storage) const;
  // Storages by the key a schedule names them with (op name, call index,
  // output): a recorded schedule of a large model names thousands per step.
  class StoragesByKey {
   public:
    StoragesByKey(const Region& region, const std::vector<StorageId>& storages);
    StorageId find(const TensorKey& key) const; // invalid: not among them

   private:
    std::map<std::tuple<int32_t, int64_t, int32_t>, StorageId> by_key_;
    std::unordered_map<std::string, int32_t> op_index_;
  };
  TensorKey key_of(StorageId storage) const;
  std::string describe_key(const TensorKey& key) const;
  int64_t strong_memo_bytes() const;
  // What the replay budget bounds: rebuilt tensors held, plus (when it
  // counts them) live outputs the policy kept.
  int64_t budgeted_bytes() const;
  // After a rebuild: the schedule's releases, or under a replay budget, lets
  // go of other rebuilt tensors until what the region holds fits (the one
  // just rebuilt for autograd stays held). Records what it released.
  void release_after_rebuild(StorageId target);
  void memoise(StorageId storage, const at::Tensor& t, StateId state);
  // Weakens the memos nothing in this pass will unpack again; forgets the
  // weak ones whose storage died.
  void release_memos();
  // An activation unpacked a second time: backward runs again
  // (retain_graph=True); every live one is pending again.
  void start_new_pass();
  // Frees what no live dropped activation can need any more: the entries
  // at or past the latest horizon among them (and the whole tape once the
  // region is closed and none is left). Backward frees saved activations
  // roughly in reverse order, so a SAVE output a replay needed goes soon
  // after its last replay, as PyTorch's SAC frees its cache.
  void release_unneeded_entries();

  mutable std::mutex mutex_;
  std::vector<std::shared_ptr<OpPolicy>> policies_; // outermost first
  // Nested regions entered so far, by id (0: this region): each one's
  // enclosing scope (-1 for 0), and the one recording now.
  IdVector<ScopeId, ScopeId> scope_parents_{ScopeId::invalid()};
  ScopeId scope_{0};
  bool allow_cache_entry_mutation_;
  const int64_t replay_budget_;
  const bool budget_counts_saved_;
  const double checkpoint_share_;
  // False when the region was entered with grad off or in inference mode:
  // no graph is built, so nothing is recorded.
  const bool records_;
  bool open_ = true;
  IdVector<EntryId, Entry> entries_;
  IdVector<StorageId, StorageRecord> storages_;
  std::unordered_map<const c10::StorageImpl*, StorageId> storage_index_;
  // Held arguments by the storage they hold: (entry, slot). The held alias
  // keeps the storage alive, so the address is not reused while listed.
  std::unordered_map<const c10::StorageImpl*, std::vector<std::pair<EntryId, int32_t>>> held_slots_;
  std::vector<OpInfo> ops_;
  std::unordered_map<c10::OperatorHandle, int32_t> op_index_;
  std::vector<StorageId> memoised_;
  int64_t live_dropped_ = 0;                 // SavedActivations referring to this region
  int64_t pass_ = 0;                         // backward passes through the region, from 0
  std::map<int32_t, int32_t> live_horizons_; // horizon -> live dropped activations
  size_t released_from_ = SIZE_MAX;          // entries from here on are released
  std::optional<ReplaySchedule> schedule_;
  std::vector<ExecutedStep> executed_; // this backward pass's rebuilds
  StorageRestorer restorer_;
  bool restored_in_replay_ = false;
  RegionStats stats_;
};

// The unpack hook: the kept tensor (version-checked as autograd would) or the
// rebuilt one.
at::Tensor unpack(const SavedActivation& saved);

} // namespace torch_sac::region
