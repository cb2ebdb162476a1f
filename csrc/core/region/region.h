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
// Parts: Region orchestrates three, each in its own header: the Tape
// (tape.h: entries, op infos, scopes), the StorageTable (storage_table.h:
// tracked storages, memos, live references) and the RebuildPlanner
// (rebuild_planner.h: what a rebuild replays and keeps).
//
// Threads: recording is thread-local; pack, unpack and the end of a saved
// activation may come from any thread and take the region's mutex, which is
// never awaited while holding the GIL (see
// csrc/python/saved_activation_handle.h).

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "csrc/core/interceptor.h"
#include "csrc/core/offload/offloader.h"
#include "csrc/core/op_policy.h"
#include "csrc/core/region/collective_agreement.h"
#include "csrc/core/region/rebuild_planner.h"
#include "csrc/core/region/replay_schedule.h"
#include "csrc/core/region/storage_table.h"
#include "csrc/core/region/tape.h"
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
  // Offloaded: its copy in host memory (csrc/core/offload/), version-checked
  // the same way on unpack.
  offload::OffloadedTensor offloaded;
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
  static constexpr int64_t kNoReplayBudget = region::kNoReplayBudget;
  // `budget_counts_saved`: the replay budget bounds rebuilt tensors plus the
  // outputs the policy kept in forward that are still alive, so the room a
  // kept checkpoint leaves when backward is past it goes to rebuilds (a
  // forward that keeps the first sweep of an optimal reversal; see
  // torch_sac/planners/peak_search.py).
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
  // Records what subclasses run on their inner tensors, not their own ops.
  bool defers_to_subclasses() const override {
    return true;
  }

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
  // Saved tensors the region kept as they are, by kind (unrecordable_kind):
  // {kind: (tensors, storage bytes)}.
  std::map<std::string, std::pair<int64_t, int64_t>> kept_as_is() const;

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

  // Recording one op (handle(), region.cpp), in the order it runs. Before
  // the op runs, with the mutex held:
  struct Writes; // what the op writes, and what replay needs kept of it
  // Why the op cannot be recorded at all (a collective, a list write or a
  // tensor the region cannot rebuild: runs as if outside the region), in
  // words (`cause`, then the tensor's `kind` if any); false when it can.
  struct Unrecordable {
    const char* cause = nullptr;
    const char* kind = nullptr;
    explicit operator bool() const {
      return cause != nullptr;
    }
  };
  static Unrecordable unrecordable(const OpFacts& facts, c10::ArrayRef<c10::IValue> inputs);
  // unrecordable()'s words, or what the op makes, for op_details' kept_why.
  static std::string unrecordable_reason(
      const OpFacts& facts,
      c10::ArrayRef<c10::IValue> inputs,
      c10::ArrayRef<c10::IValue> outputs);
  // An op the policy would recompute ran unrecorded (or wrote storages that
  // can no longer be rebuilt, `why`): what it made and wrote is kept
  // whenever autograd saves it, and the packs say whose it is.
  void note_unreplayable(
      int32_t op_index,
      const OpFacts& facts,
      c10::ArrayRef<c10::IValue> inputs,
      c10::ArrayRef<c10::IValue> outputs,
      const std::vector<StorageId>& written,
      const char* why = nullptr);
  // A pack kept `t`: counted against the op note_unreplayable named, if any.
  void count_kept_anyway(const at::Tensor& t);
  // Inputs the region tracks are met again: notes writes it did not see.
  void observe_inputs(c10::ArrayRef<c10::IValue> inputs);
  // The storages the op writes; copies of the ones replay cannot rebuild,
  // taken before the op overwrites them.
  Writes prepare_writes(const OpFacts& facts, c10::ArrayRef<c10::IValue> inputs, bool recordable);
  // The op ran and the policy decided (without the mutex). Then, with it:
  // the storages of its new outputs, tracked; returns their bytes (-1: none).
  int64_t track_outputs(
      Entry& entry,
      EntryId index,
      c10::ArrayRef<c10::IValue> inputs,
      c10::ArrayRef<c10::IValue> outputs,
      bool save);
  // The policy's decision, in the stats and the op's counts.
  void count_decision(OpInfo& info, int64_t call_index, Policy decision, int64_t new_bytes);
  // MUST_OFFLOAD for an op with an output that cannot be offloaded raises,
  // naming the op and why.
  static void check_must_offload(
      const OpFacts& facts,
      c10::ArrayRef<c10::IValue> inputs,
      c10::ArrayRef<c10::IValue> outputs,
      bool recordable);
  // What a replay of the entry needs: its arguments, RNG and numerics.
  void record_for_replay(
      Entry& entry,
      c10::ArrayRef<c10::IValue> inputs,
      const std::vector<c10::IValue>& overwritten,
      std::optional<RngSnapshot> rng);

  // The storage is the output of a collective a replay may run.
  bool is_collective_output(StorageId storage) const;
  // Runs a c10d collective that fills a buffer, noting the storages its
  // backend makes on this thread meanwhile (backend_scratch_).
  void run_noting_backend_scratch(torch::jit::Stack* stack, RunOp run);
  // Whether every tensor the op is passed is the scratch of a c10d
  // collective's backend or a buffer such a collective filled and nothing
  // has read since (and one is scratch): gloo's reduce-scatter copies its
  // share from its scratch into the buffer when waited for, in ops on this
  // thread that are the collective's, not the program's.
  bool finishes_backend_collective(c10::ArrayRef<c10::IValue> inputs) const;
  // The collectives a rebuild of the entry's outputs (and of what it
  // writes) may replay (StorageRecord::collective_deps).
  void note_collective_deps(
      const Entry& entry,
      EntryId index,
      bool collective,
      const std::vector<StorageId>& written);
  // Before a rebuild of `saved`, with or without a replay: replays the
  // collectives it depends on that this pass has not (pinned), in tape
  // order. Where the first replay of a collective happens then depends
  // only on the order of unpacks, the same on every rank, never on what is
  // still alive.
  void replay_collectives_for(const SavedActivation& saved);
  // After a rebuild: a pinned storage whose every replayable reader has its
  // outputs held already (strong memos of unmutated storages) can only be
  // reached through them, so they are pinned instead and it is let go,
  // when they hold no more bytes than it. DTensor's all-gather buffer gives
  // way to the tensor its redistribution assembles from it, a
  // reduce-scatter's output to the residual sum it feeds. Returns the
  // storages let go of. Also called inside a replay, as memos are made.
  std::vector<StorageId> move_pins_downstream();
  // The replayable entries reading `storage` (found once, cached).
  const std::vector<EntryId>& readers_of(StorageId storage);
  // materialize(), with the storage restorer's end (FSDP2) after it.
  c10::Storage materialize_restoring(StorageId storage, StateId state, ScopeId scope);

  SavedActivation pack_locked(const at::Tensor& t);
  void forget_locked(StorageId storage, int64_t unpacked_pass, int32_t horizon);
  // A replay on this thread holds mutex_: an activation freed by code the
  // replay runs (a Python kernel dropping a graph, a garbage collection) is
  // forgotten when that rebuild ends, not waited for (it would never come).
  bool replaying_on_this_thread() const;
  void forget_after_replay(const SavedActivation& saved);
  // What forget_after_replay noted, when the rebuild ends (mutex_ held).
  void forget_deferred();
  friend class ReplayOnThisThread;
  Policy decide(const OpCall& call, const std::string& op_name);

  // Replay (replay.cpp); called with mutex_ held.
  //
  // Rebuilds `storage` at `state` for a saved activation of `scope`: runs
  // the planner's plan in tape order, each entry once, freeing each
  // intermediate after its last use in the plan and keeping what the
  // planner allows.
  c10::Storage materialize(StorageId storage, StateId state, ScopeId scope);
  // A held argument must still be what the op read: same version, and its
  // storage not freed or shrunk since (FSDP2 frees unsharded parameters).
  void check_held(const ArgSlot& slot, const Entry& consumer);
  torch::jit::Stack replay_entry(
      EntryId entry_index,
      c10::function_ref<at::Tensor(const ArgSlot&)> resolve);
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
  bool allow_cache_entry_mutation_;
  const bool has_budget_;
  // False when the region was entered with grad off or in inference mode:
  // no graph is built, so nothing is recorded.
  const bool records_;
  bool open_ = true;
  RegionStats stats_;
  std::unordered_map<StorageId, std::vector<EntryId>> pin_readers_; // readers_of()
  std::map<std::string, std::pair<int64_t, int64_t>> kept_as_is_;   // kept_as_is()
  // Storages note_unreplayable saw, until close(): the op, and whether
  // their bytes were counted yet (once per storage).
  struct UnreplayableBy {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    int32_t op_index;
    bool counted = false;
  };
  std::unordered_map<const c10::StorageImpl*, UnreplayableBy> unreplayable_by_;
  // Storages c10d collectives' backends made on this thread as they ran,
  // until close() (see finishes_backend_collective).
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>>
      backend_scratch_;
  // The parts (declared before the planner, which refers to them).
  Tape tape_;              // what forward recorded (tape.h)
  StorageTable storages_;  // tracked storages, memos, live references (storage_table.h)
  RebuildPlanner planner_; // what a rebuild replays and keeps (rebuild_planner.h)
  // Functional collectives met in forward, checked across ranks on close().
  CollectiveAgreement collectives_;
  StorageRestorer restorer_;
  bool restored_in_replay_ = false;
  // The thread whose rebuild holds mutex_ (none: default id), and the
  // activations freed by that rebuild's own code (see forget_after_replay;
  // guarded by mutex_).
  std::atomic<std::thread::id> replaying_thread_{};
  struct DeferredForget {
    StorageId storage;
    int64_t unpacked_pass;
    int32_t horizon;
  };
  std::vector<DeferredForget> deferred_forgets_;
};

// The unpack hook: the kept tensor (version-checked as autograd would) or the
// rebuilt one.
at::Tensor unpack(const SavedActivation& saved);

} // namespace torch_sac::region
