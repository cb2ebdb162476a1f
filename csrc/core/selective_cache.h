#pragma once
// The drop-in for torch.utils.checkpoint.create_selective_checkpoint_contexts:
// a caching handler for forward and a cached handler for recompute sharing one
// SelectiveCache. Forward caches the outputs of SAVE ops keyed by
// (op, call index), and host copies of OFFLOAD ops' outputs
// (csrc/core/offload/); recompute hands cached outputs back and runs the rest.
//
// Recompute re-runs the user's Python function, so the cache also checks
// that it runs what forward ran, and that nothing forward read changed:
//  * forward records each (op, call index) with its output shapes and dtypes;
//    recompute must meet only calls forward made, with the same output
//    shapes and dtypes (it may stop early, and skip an op Python code
//    cached, as PyTorch's SAC allows);
//  * a tensor forward read whose storage recompute reads again must be at
//    the version forward read (a tensor from outside the region modified
//    between forward and backward);
//  * a cached output is watched by storage: a write to it later in forward,
//    through any alias (a view, `_unsafe_view`, `out=`), drops it from the
//    cache so recompute runs it again; a write after forward through any
//    alias forward saw raises at the cache hit;
//  * an op that wrote in forward to a storage recompute meets again (BatchNorm
//    running statistics, a parameter, a `.grad`) writes to a copy in
//    recompute: forward's update happens exactly once;
//  * recompute runs under the default dtype, determinism switches and matmul
//    precision forward started with (numerics_state.h);
//  * random ops are always recomputed: recompute restores the RNG state
//    forward started from, so a random op served from the cache would not
//    draw and every random op after it would draw different numbers (an
//    attention kernel called with dropout_p=0 draws nothing and may be cached:
//    call_draws_random in op_facts.h, the rule the region engine uses too).

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/SmallVector.h>
#include <c10/util/flat_hash_map.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "csrc/core/interceptor.h"
#include "csrc/core/numerics_state.h"
#include "csrc/core/offload/offloader.h"
#include "csrc/core/op_facts.h"
#include "csrc/core/op_policy.h"
#include "csrc/core/stats.h"

namespace torch_sac {

// What happened to one op overload's calls in a region.
struct OpSummary {
  std::string op;         // "aten::mm.default"
  int64_t saved = 0;      // calls whose outputs were cached in forward
  int64_t dropped = 0;    // calls left to recompute
  int64_t recomputed = 0; // calls re-run during recompute
  // The same calls counted as the region engine counts them, so profiles of
  // both engines compare: only calls that made new tensors (no view, no
  // in-place op), and the storage bytes of those tensors.
  int64_t saved_new = 0;
  int64_t dropped_new = 0;
  int64_t saved_bytes = 0;
  int64_t dropped_bytes = 0;
  int64_t offloaded_new = 0; // of saved_new: outputs forward offloaded to host memory
  int64_t offloaded_bytes = 0;
  int64_t recompute_ns = 0;
  std::vector<int64_t> recomputes_by_call; // by forward call index
};

class SelectiveCache {
 public:
  enum class EntryState : uint8_t { Recompute, Cached, Consumed };

  // A storage forward met, weakly: recompute compares identities with it.
  using WeakStorage = std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>>;
  struct InputSeen {
    WeakStorage storage; // empty for tensors without storage
    uint32_t version = 0;
  };
  struct StorageWritten {
    uint32_t input = 0; // position among the op's tensor inputs
    WeakStorage storage;
  };
  // Whether `seen` is `storage`, still alive.
  static bool same_storage(const WeakStorage& seen, const c10::StorageImpl* storage) {
    return storage && seen && seen->use_count() > 0 && seen->_unsafe_get_target() == storage;
  }

  // What recompute hands back for a cached call, kept only while the call
  // is cached.
  struct CachedOutputs {
    // Outputs as recompute hands them back: floating-point/complex tensors and
    // outputs of aliasing ops are replaced by detached aliases sharing storage
    // and version counter; other tensors are kept as they are (PyTorch gives
    // those back as the same object).
    std::vector<c10::IValue> outputs;
    int64_t bytes = 0;
    // Version counters of every tensor forward saw on the cached storages
    // (the outputs, their views, `_unsafe_view` aliases with counters of
    // their own), and their versions when forward ended.
    std::vector<c10::VariableVersion> watched;
    std::vector<uint32_t> watched_versions;
    // Tensors in host memory (an OFFLOAD decision): which output, which of
    // its tensors (in map_tensors order: a list's elements), left undefined
    // in `outputs` until recompute reloads it; and their bytes.
    struct Offloaded {
      size_t output;
      int32_t element;
      offload::OffloadedTensor tensor;
    };
    std::vector<Offloaded> offloaded;
    int64_t offloaded_bytes = 0;
  };

  struct Entry {
    EntryState state = EntryState::Recompute;
    // Whether the call made new tensors (an output on a storage no argument
    // lives on), and their storage bytes: what a profile reports as kept or
    // dropped.
    bool made_new = false;
    int64_t new_bytes = 0;
    // Shapes and dtypes of the outputs, hashed.
    uint64_t signature = 0;
    // The first tensor output's sizes (-1 for a symbolic size), kept to say
    // how recompute's outputs differ when their signature does not match.
    c10::SmallVector<int64_t, 4> first_output_sizes;
    // The call's tensor inputs in for_each_tensor order:
    // inputs_seen_[inputs_begin, inputs_begin + num_inputs). One array for
    // the whole region, so recording a call allocates nothing.
    size_t inputs_begin = 0;
    size_t num_inputs = 0;
    std::vector<StorageWritten> writes;
    int64_t position = 0;                  // among all ops forward recorded
    int64_t recomputed = 0;                // times recompute re-ran this call
    bool offloaded = false;                // its cached outputs went to host memory
    std::unique_ptr<CachedOutputs> cached; // set while state is Cached
  };

  // Everything the region knows about one op overload, found with a single
  // hash lookup per intercepted op.
  struct OpRecord {
    OpRecord(const c10::OperatorHandle& handle, std::shared_ptr<const OpFacts> op_facts)
        : facts(std::move(op_facts)), op(handle) {}
    // What the op's schema and tags say (op_facts.h), the same in every
    // region and in the region engine.
    std::shared_ptr<const OpFacts> facts;
    // Indexed by forward call index. Most ops run a few times per region:
    // their entries live in the record, not in a vector regrown per call.
    c10::SmallVector<Entry, 4> entries;
    int64_t forward_calls = 0;   // call counter of the caching handler
    int64_t recompute_calls = 0; // call counter of the cached handler
    int64_t recomputed = 0;      // calls re-run during recompute
    int64_t recompute_ns = 0;    // their time
    c10::OperatorHandle op;
  };

  // Forward starts: records only when grad is on (as autograd saves only then).
  void begin_forward();
  // Forward ended: the versions cached outputs must still have at recompute.
  void finish_forward();
  // Recompute starts (again): call indices count from 0, and the process-wide
  // numerics settings are forward's until finish_recompute().
  void begin_recompute();
  void finish_recompute();
  bool records() const {
    return records_;
  }

  OpRecord& record_for(const c10::OperatorHandle& op);
  SelectiveCacheStats& stats() {
    return stats_;
  }
  // Per-op counts (ignored ops left out), in the order ops were first seen.
  std::vector<OpSummary> summary() const;
  // (op, call index) of every call whose outputs forward cached, in the
  // order ops were first seen, then by call index.
  std::vector<std::pair<c10::OperatorHandle, int64_t>> saved_calls() const;

 private:
  friend class CachingHandler;
  friend class CachedHandler;

  void cache_outputs(
      OpRecord& record,
      int64_t call_index,
      c10::ArrayRef<c10::IValue> outputs,
      Policy decision);
  // Drops the cached entries whose outputs live on `storage`.
  void invalidate(const c10::StorageImpl* storage);
  void watch_aliases(c10::ArrayRef<c10::IValue> outputs);

  // Every intercepted op meets these maps, forward and recompute: open
  // addressing, so a lookup hashes no strings and an insert allocates only
  // when the table grows.
  ska::flat_hash_map<c10::OperatorHandle, std::unique_ptr<OpRecord>> records_by_op_;
  std::vector<OpRecord*> first_seen_order_;
  int64_t forward_ops_ = 0; // ops recorded in forward: the next one's position
  // Tensor inputs of every call forward recorded (see Entry::inputs_begin).
  std::vector<InputSeen> inputs_seen_;
  // Cached entries by the storages their outputs live on.
  ska::flat_hash_map<const c10::StorageImpl*, std::vector<std::pair<OpRecord*, int64_t>>>
      cached_storages_;
  // Storages of every op output in forward (so possibly made anew by
  // recompute), and storages forward wrote to, with its last write.
  ska::flat_hash_set<const c10::StorageImpl*> produced_;
  ska::flat_hash_map<const c10::StorageImpl*, int64_t> last_write_;
  bool records_ = true;
  bool forward_finished_ = false;
  NumericsState forward_numerics_;
  std::optional<NumericsGuard> recompute_numerics_;
  SelectiveCacheStats stats_;
};

class CachingHandler final : public OpHandler {
 public:
  CachingHandler(std::shared_ptr<SelectiveCache> cache, std::shared_ptr<OpPolicy> policy);
  void handle(
      const c10::OperatorHandle& op,
      torch::jit::Stack* stack,
      RunOp run,
      const void* adapter_view) override;
  // Forward is over: the policy is never asked again. Letting go of it
  // breaks reference cycles through Python policies (a module whose bound
  // method is the policy and which keeps the contexts for stats()).
  void release_policy() {
    policy_.reset();
  }

 private:
  // MUST_OFFLOAD for an op with an output that cannot be offloaded raises,
  // naming the op and why.
  static void check_must_offload(
      const SelectiveCache::OpRecord& record,
      c10::ArrayRef<SelectiveCache::InputSeen> inputs,
      c10::ArrayRef<c10::IValue> outputs);

  std::shared_ptr<SelectiveCache> cache_;
  std::shared_ptr<OpPolicy> policy_;
};

class CachedHandler final : public OpHandler {
 public:
  CachedHandler(std::shared_ptr<SelectiveCache> cache, bool allow_cache_entry_mutation);
  void handle(
      const c10::OperatorHandle& op,
      torch::jit::Stack* stack,
      RunOp run,
      const void* adapter_view) override;

 private:
  void check_inputs(
      const SelectiveCache::OpRecord& record,
      int64_t call_index,
      c10::ArrayRef<c10::IValue> inputs) const;
  void check_cached_unchanged(const SelectiveCache::OpRecord& record, int64_t call_index) const;

  std::shared_ptr<SelectiveCache> cache_;
  bool allow_cache_entry_mutation_;
};

// The pair of handlers create_selective_checkpoint_contexts returns, sharing
// one cache.
struct SelectiveCheckpoint {
  std::shared_ptr<SelectiveCache> cache;
  std::shared_ptr<CachingHandler> caching;
  std::shared_ptr<CachedHandler> cached;
};
SelectiveCheckpoint make_selective_checkpoint(
    std::shared_ptr<OpPolicy> policy,
    bool allow_cache_entry_mutation);

} // namespace torch_sac
