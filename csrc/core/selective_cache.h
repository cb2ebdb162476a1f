#pragma once
// The drop-in for torch.utils.checkpoint.create_selective_checkpoint_contexts:
// a caching handler for forward and a cached handler for recompute sharing one
// SelectiveCache. Forward caches the outputs of SAVE ops keyed by
// (op, call index) with their version counters; recompute hands cached outputs
// back and runs the rest.

#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "interceptor.h"
#include "op_policy.h"

namespace torch_sac {

struct SelectiveCacheStats {
  int64_t policy_calls = 0;
  int64_t saved_ops = 0;
  int64_t saved_bytes = 0;
  int64_t recomputed_ops = 0;
  int64_t cache_hits = 0;
};

// What happened to one op overload's calls in a region.
struct OpSummary {
  std::string op;         // "aten::mm.default"
  int64_t saved = 0;      // calls whose outputs were cached in forward
  int64_t dropped = 0;    // calls left to recompute
  int64_t recomputed = 0; // calls re-run during recompute
};

class SelectiveCache {
 public:
  enum class EntryState : uint8_t { Recompute, Cached, Consumed };

  struct Entry {
    EntryState state = EntryState::Recompute;
    // Outputs as recompute hands them back: floating-point/complex tensors and
    // outputs of aliasing ops are replaced by detached aliases sharing storage
    // and version counter; other tensors are kept as they are (PyTorch gives
    // those back as the same object).
    std::vector<c10::IValue> outputs;
    // Version of each cached tensor at caching time, in outputs order.
    std::vector<uint32_t> versions;
  };

  // Everything the region knows about one op overload, found with a single
  // hash lookup per intercepted op.
  struct OpRecord {
    bool ignored = false;           // in the ignored set: never cached
    std::vector<Entry> entries;     // indexed by forward call index
    int64_t forward_calls = 0;      // call counter of the caching handler
    int64_t recompute_calls = 0;    // call counter of the cached handler
    int64_t recomputed = 0;         // calls re-run during recompute
  };

  OpRecord& record_for(const c10::OperatorHandle& op);
  void reset_recompute_calls();
  SelectiveCacheStats& stats() {
    return stats_;
  }
  // Per-op counts (ignored ops left out), in the order ops were first seen.
  std::vector<OpSummary> summary() const;
  // (op, call index) of every call whose outputs forward cached, in the
  // order ops were first seen, then by call index.
  std::vector<std::pair<c10::OperatorHandle, int64_t>> saved_calls() const;

 private:
  std::unordered_map<c10::OperatorHandle, OpRecord> records_;
  std::vector<c10::OperatorHandle> first_seen_order_;
  SelectiveCacheStats stats_;
};

class CachingHandler final : public OpHandler {
 public:
  CachingHandler(
      std::shared_ptr<SelectiveCache> cache,
      std::shared_ptr<OpPolicy> policy);
  void handle(
      const c10::OperatorHandle& op,
      torch::jit::Stack* stack,
      RunOp run,
      const void* adapter_view) override;

 private:
  std::shared_ptr<SelectiveCache> cache_;
  std::shared_ptr<OpPolicy> policy_;
};

class CachedHandler final : public OpHandler {
 public:
  CachedHandler(
      std::shared_ptr<SelectiveCache> cache,
      bool allow_cache_entry_mutation);
  void handle(
      const c10::OperatorHandle& op,
      torch::jit::Stack* stack,
      RunOp run,
      const void* adapter_view) override;
  // Recompute restarts counting at call 0 each time it is entered.
  void reset_call_counts() {
    cache_->reset_recompute_calls();
  }

 private:
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
