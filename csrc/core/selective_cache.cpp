#include "selective_cache.h"

#include <ATen/core/Tensor.h>

#include "detached_alias.h"
#include "ignored_ops.h"
#include "ivalue_tensors.h"
#include "op_name.h"

namespace torch_sac {
namespace {

int64_t tensor_bytes(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : 0;
}

// PyTorch's SAC hands back a cached tensor of non-differentiable dtype that no
// return of the op aliases as the very same object; everything else as a
// fresh detached alias.
at::Tensor cacheable(const at::Tensor& t, bool op_returns_alias) {
  if (!t.defined() || op_returns_alias || t.is_floating_point() || t.is_complex()) {
    return detached_alias(t);
  }
  return t;
}

bool returns_alias(const c10::OperatorHandle& op) {
  for (const auto& ret : op.schema().returns()) {
    if (ret.alias_info()) {
      return true;
    }
  }
  return false;
}

} // namespace

CachingHandler::CachingHandler(
    std::shared_ptr<SelectiveCache> cache,
    std::shared_ptr<OpPolicy> policy)
    : cache_(std::move(cache)), policy_(std::move(policy)) {
  TORCH_CHECK(cache_ && policy_, "torch_sac: CachingHandler needs a cache and a policy");
}

void CachingHandler::handle(
    const c10::OperatorHandle& op,
    torch::jit::Stack* stack,
    RunOp run,
    const void* adapter_view) {
  if (recording_disabled()) {
    run(stack);
    return;
  }
  SelectiveCache::OpRecord& record = cache_->record_for(op);
  if (record.ignored) {
    run(stack);
    return;
  }
  const size_t num_args = op.schema().arguments().size();
  TORCH_INTERNAL_ASSERT(stack->size() >= num_args);
  // A policy that looks at the inputs sees them after the op ran (torch calls
  // it with op_output), so keep them; in-place ops return their input anyway.
  std::vector<c10::IValue> inputs;
  if (policy_->needs_values()) {
    inputs.assign(stack->end() - num_args, stack->end());
  }
  run(stack);
  const size_t num_returns = op.schema().returns().size();
  c10::ArrayRef<c10::IValue> outputs(stack->data() + stack->size() - num_returns, num_returns);

  const int64_t call_index = record.forward_calls++;
  const Policy decision =
      policy_->decide(OpCall{op, inputs, outputs, call_index, adapter_view});
  auto& stats = cache_->stats();
  ++stats.policy_calls;

  auto& entries = record.entries;
  if (entries.size() <= static_cast<size_t>(call_index)) {
    entries.resize(call_index + 1);
  }
  SelectiveCache::Entry& entry = entries[call_index];
  entry = SelectiveCache::Entry{};
  if (!is_save(decision)) {
    return;
  }
  entry.state = SelectiveCache::EntryState::Cached;
  entry.outputs.reserve(num_returns);
  const bool op_returns_alias = returns_alias(op);
  for (const c10::IValue& out : outputs) {
    entry.outputs.push_back(map_tensors(out, [&](const at::Tensor& t) {
      entry.versions.push_back(t.defined() ? t._version() : 0);
      stats.saved_bytes += tensor_bytes(t);
      return cacheable(t, op_returns_alias);
    }));
  }
  ++stats.saved_ops;
}

CachedHandler::CachedHandler(
    std::shared_ptr<SelectiveCache> cache,
    bool allow_cache_entry_mutation)
    : cache_(std::move(cache)),
      allow_cache_entry_mutation_(allow_cache_entry_mutation) {
  TORCH_CHECK(cache_, "torch_sac: CachedHandler needs a cache");
}

void CachedHandler::handle(
    const c10::OperatorHandle& op,
    torch::jit::Stack* stack,
    RunOp run,
    const void* /*adapter_view*/) {
  if (recording_disabled()) {
    run(stack);
    return;
  }
  SelectiveCache::OpRecord& record = cache_->record_for(op);
  if (record.ignored) {
    run(stack);
    return;
  }
  const int64_t call_index = record.recompute_calls++;
  auto& entries = record.entries;
  TORCH_CHECK(
      static_cast<size_t>(call_index) < entries.size(),
      "torch_sac: ", op_display_name(op), " (call ", call_index,
      ") ran during recompute but not in forward. The checkpointed region must "
      "run the same ops in backward as in forward: avoid data-dependent control "
      "flow and global state that changes between forward and backward.");
  SelectiveCache::Entry& entry = entries[call_index];
  auto& stats = cache_->stats();
  switch (entry.state) {
    case SelectiveCache::EntryState::Recompute:
      run(stack);
      ++record.recomputed;
      ++stats.recomputed_ops;
      return;
    case SelectiveCache::EntryState::Consumed:
      TORCH_CHECK(
          false,
          "Trying to backward an extra time. You are only allowed to backward "
          "once on any region computed under selective activation checkpoint "
          "(torch_sac: the cached output of ", op_display_name(op), " call ",
          call_index, " was already used by an earlier backward).");
    case SelectiveCache::EntryState::Cached:
      break;
  }
  if (!allow_cache_entry_mutation_) {
    size_t i = 0;
    for (const c10::IValue& out : entry.outputs) {
      for_each_tensor(out, [&](const at::Tensor& t) {
        const uint32_t cached_version = entry.versions[i++];
        TORCH_CHECK(
            !t.defined() || t._version() == cached_version,
            "torch_sac: an output of ", op_display_name(op), " (call ",
            call_index, ") was cached by selective activation checkpointing "
            "and then mutated in place (version ", cached_version, " -> ",
            t._version(), ") before backward, so backward would see wrong "
            "values. Make the policy recompute this op, avoid the in-place "
            "op, or pass allow_cache_entry_mutation=True if the mutation is "
            "intended.");
      });
    }
  }
  torch::jit::drop(*stack, op.schema().arguments().size());
  for (c10::IValue& out : entry.outputs) {
    stack->push_back(std::move(out));
  }
  entry.outputs.clear();
  entry.versions.clear();
  entry.state = SelectiveCache::EntryState::Consumed;
  ++stats.cache_hits;
}

SelectiveCache::OpRecord& SelectiveCache::record_for(const c10::OperatorHandle& op) {
  auto [it, inserted] = records_.try_emplace(op);
  if (inserted) {
    it->second.ignored = is_ignored_op(op.operator_name());
    first_seen_order_.push_back(op);
  }
  return it->second;
}

void SelectiveCache::reset_recompute_calls() {
  for (auto& [op, record] : records_) {
    record.recompute_calls = 0;
  }
}

std::vector<OpSummary> SelectiveCache::summary() const {
  std::vector<OpSummary> out;
  out.reserve(first_seen_order_.size());
  for (const auto& op : first_seen_order_) {
    const OpRecord& record = records_.at(op);
    if (record.ignored) {
      continue;
    }
    OpSummary s{op_display_name(op)};
    for (const Entry& e : record.entries) {
      (e.state == EntryState::Recompute ? s.dropped : s.saved) += 1;
    }
    s.recomputed = record.recomputed;
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<std::pair<c10::OperatorHandle, int64_t>> SelectiveCache::saved_calls() const {
  std::vector<std::pair<c10::OperatorHandle, int64_t>> out;
  for (const auto& op : first_seen_order_) {
    const auto& entries = records_.at(op).entries;
    for (size_t i = 0; i < entries.size(); ++i) {
      if (entries[i].state != EntryState::Recompute) {
        out.emplace_back(op, static_cast<int64_t>(i));
      }
    }
  }
  return out;
}

SelectiveCheckpoint make_selective_checkpoint(
    std::shared_ptr<OpPolicy> policy,
    bool allow_cache_entry_mutation) {
  auto cache = std::make_shared<SelectiveCache>();
  return SelectiveCheckpoint{
      cache,
      std::make_shared<CachingHandler>(cache, std::move(policy)),
      std::make_shared<CachedHandler>(cache, allow_cache_entry_mutation)};
}

} // namespace torch_sac
