#include "csrc/core/selective_cache.h"

#include <ATen/core/Tensor.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/SmallVector.h>
#include <c10/util/hash.h>

#include <algorithm>
#include <chrono>
#include <sstream>

#include "csrc/core/detached_alias.h"
#include "csrc/core/ivalue_tensors.h"
#include "csrc/core/op_name.h"
#include "csrc/core/replay_guard.h"
#include "csrc/core/tensor_version.h"

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

const c10::StorageImpl* storage_of(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

// Shapes and dtypes of an op's outputs, hashed: recompute must make the same.
uint64_t signature_of(c10::ArrayRef<c10::IValue> outputs) {
  size_t h = outputs.size();
  for (const c10::IValue& out : outputs) {
    for_each_tensor(out, [&](const at::Tensor& t) {
      if (!t.defined()) {
        h = c10::hash_combine(h, 0x9e37);
        return;
      }
      h = c10::hash_combine(h, static_cast<size_t>(t.scalar_type()));
      h = c10::hash_combine(h, static_cast<size_t>(t.layout()));
      if (t.is_nested()) {
        return; // no sizes() to compare
      }
      for (const c10::SymInt& s : t.sym_sizes()) {
        h = c10::hash_combine(
            h, s.is_heap_allocated() ? 0x51 : static_cast<size_t>(s.as_int_unchecked()));
      }
    });
  }
  return h;
}

std::string describe_outputs(c10::ArrayRef<c10::IValue> outputs) {
  std::ostringstream out;
  const char* sep = "";
  for (const c10::IValue& v : outputs) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      out << sep;
      sep = ", ";
      if (!t.defined()) {
        out << "undefined";
      } else if (t.is_nested()) {
        out << t.scalar_type() << " nested";
      } else {
        out << t.scalar_type() << t.sizes();
      }
    });
  }
  return out.str();
}

// Calls fn(tensor, position) for every tensor argument, numbered in
// for_each_tensor order, with a setter that replaces it on the stack.
template <typename Fn>
void for_each_tensor_arg(torch::jit::Stack& args, Fn&& fn) {
  uint32_t position = 0;
  for (c10::IValue& arg : args) {
    if (arg.isTensor()) {
      fn(arg.toTensor(), position++, [&](at::Tensor t) { arg = std::move(t); });
    } else if (arg.isTensorList() || arg.isList()) {
      const size_t n = arg.isTensorList() ? arg.toTensorList().size() : arg.toListRef().size();
      for (size_t k = 0; k < n; ++k) {
        c10::IValue element = arg.isTensorList() ? c10::IValue(arg.toTensorList().get(k))
                                                 : arg.toList().get(k);
        if (!element.isTensor()) {
          continue;
        }
        fn(element.toTensor(), position++, [&arg, k](at::Tensor t) {
          // Lists are shared with the caller: replace in a copy.
          if (arg.isTensorList()) {
            auto list = arg.toTensorList().copy();
            list.set(k, std::move(t));
            arg = std::move(list);
          } else {
            auto list = arg.toList().copy();
            list.set(k, std::move(t));
            arg = std::move(list);
          }
        });
      }
    }
  }
}

c10::SmallVector<int64_t, 4> first_output_sizes(c10::ArrayRef<c10::IValue> outputs) {
  c10::SmallVector<int64_t, 4> sizes;
  bool found = false;
  for (const c10::IValue& out : outputs) {
    for_each_tensor(out, [&](const at::Tensor& t) {
      if (found || !t.defined() || t.is_nested()) {
        return;
      }
      found = true;
      for (const c10::SymInt& s : t.sym_sizes()) {
        sizes.push_back(s.is_heap_allocated() ? -1 : s.as_int_unchecked());
      }
    });
    if (found) {
      break;
    }
  }
  return sizes;
}

// The dimension along which recompute's first output is larger than
// forward's, all other sizes equal: what a cache the checkpointed function
// appends to (past_key_values) looks like when recompute runs after forward
// filled it.
std::optional<size_t> grown_dim(
    c10::ArrayRef<int64_t> forward_sizes,
    c10::ArrayRef<int64_t> recompute_sizes) {
  if (forward_sizes.size() != recompute_sizes.size()) {
    return std::nullopt;
  }
  std::optional<size_t> grown;
  for (size_t d = 0; d < forward_sizes.size(); ++d) {
    if (forward_sizes[d] == recompute_sizes[d]) {
      continue;
    }
    if (grown || forward_sizes[d] < 0 || recompute_sizes[d] <= forward_sizes[d]) {
      return std::nullopt;
    }
    grown = d;
  }
  return grown;
}

constexpr const char* kDropinFixes =
    "The region engine needs no re-run: torch_sac.checkpoint, sac_context or "
    "apply_sac(engine=\"region\") replay the recorded ops in backward and run no Python "
    "again.";

// Recompute ran an op forward did not run at this point: the checkpointed
// function took another path the second time.
[[noreturn]] void recompute_took_other_path(
    const c10::OperatorHandle& op,
    int64_t call_index,
    const std::string& what) {
  TORCH_CHECK(
      false, "torch_sac: recompute does not match forward: ", op_display_name(op), " (call ",
      call_index, ") ", what,
      ". Recompute re-runs the checkpointed function, so it took "
      "another path than forward: Python control flow that depends on state changed "
      "between forward and backward (a flag, a counter, Python randomness, a cache that "
      "forward filled), or backward()/an optimizer step inside the function. Make that "
      "state the same for both runs; for a Hugging Face model, whose cache (past_key_values, "
      "cache_params) forward fills, call it with use_cache=False when training. ",
      kDropinFixes);
}

// Recompute's outputs of one call differ in shape or dtype from forward's.
[[noreturn]] void recompute_outputs_differ(
    const c10::OperatorHandle& op,
    int64_t call_index,
    c10::ArrayRef<int64_t> forward_sizes,
    c10::ArrayRef<c10::IValue> outputs) {
  const auto sizes = first_output_sizes(outputs);
  if (const auto d = grown_dim(forward_sizes, sizes)) {
    TORCH_CHECK(
        false, "torch_sac: recompute does not match forward: ", op_display_name(op), " (call ",
        call_index, ") made an output ", c10::IntArrayRef(sizes), " that grew along dim ", *d,
        " from ", forward_sizes[*d], " to ", sizes[*d], " since forward (",
        c10::IntArrayRef(forward_sizes),
        "). That is a cache the checkpointed function "
        "appends to, such as a Hugging Face model's past_key_values: forward filled it, "
        "and recompute, which re-runs the function, appended again. Train without the "
        "cache (call a Hugging Face model with use_cache=False, or set "
        "model.config.use_cache = False), or keep the cache out of the checkpointed "
        "function. ",
        kDropinFixes);
  }
  TORCH_CHECK(
      false, "torch_sac: recompute does not match forward: ", op_display_name(op), " (call ",
      call_index, ") made outputs [", describe_outputs(outputs),
      "] whose shapes or dtypes "
      "differ from forward's (first output ",
      c10::IntArrayRef(forward_sizes),
      "). "
      "Recompute re-runs the checkpointed function, which computed on other shapes or "
      "dtypes the second time: state changed between forward and backward (autocast "
      "entered or left, a flag, a cache, the inputs modified). Make that state the same "
      "for both runs. ",
      kDropinFixes);
}

} // namespace

void SelectiveCache::begin_forward() {
  records_ = !recording_disabled();
  forward_numerics_ = NumericsState::current();
  if (records_) {
    // Regions usually record tens of ops (a small transformer block about
    // 50, of some 25 overloads): grown from empty, each of these would be
    // reallocated or rehashed several times per region. A one-op region pays
    // a few kB it does not use.
    records_by_op_.reserve(64);
    first_seen_order_.reserve(64);
    inputs_seen_.reserve(256);
    produced_.reserve(128);
  }
}

void SelectiveCache::finish_forward() {
  if (forward_finished_) {
    return;
  }
  forward_finished_ = true;
  for (OpRecord* record : first_seen_order_) {
    for (Entry& entry : record->entries) {
      if (entry.state != EntryState::Cached) {
        continue;
      }
      SelectiveCache::CachedOutputs& cached = *entry.cached;
      cached.watched_versions.clear();
      cached.watched_versions.reserve(cached.watched.size());
      for (const c10::VariableVersion& counter : cached.watched) {
        cached.watched_versions.push_back(current_version(counter));
      }
    }
  }
}

void SelectiveCache::begin_recompute() {
  finish_forward();
  // Offloaded outputs come back in the order recompute will use them, as
  // far as the prefetch budget goes; each one used then brings back the
  // earlier regions' (offloader.h).
  std::vector<std::pair<int64_t, const offload::OffloadedTensor*>> offloaded;
  for (OpRecord* record : first_seen_order_) {
    for (const Entry& entry : record->entries) {
      if (entry.state == EntryState::Cached) {
        for (const auto& o : entry.cached->offloaded) {
          offloaded.emplace_back(entry.position, &o.tensor);
        }
      }
    }
  }
  std::sort(offloaded.begin(), offloaded.end(), [](const auto& a, const auto& b) {
    return a.first < b.first;
  });
  for (const auto& [position, tensor] : offloaded) {
    tensor->prefetch();
  }
  for (OpRecord* record : first_seen_order_) {
    record->recompute_calls = 0;
  }
  recompute_numerics_.reset();
  recompute_numerics_.emplace(forward_numerics_);
}

void SelectiveCache::finish_recompute() {
  recompute_numerics_.reset();
}

SelectiveCache::OpRecord& SelectiveCache::record_for(const c10::OperatorHandle& op) {
  auto it = records_by_op_.find(op);
  if (it != records_by_op_.end()) {
    return *it->second;
  }
  auto& record = records_by_op_.emplace(op, std::make_unique<OpRecord>(op, op_facts(op)))
                     .first->second;
  first_seen_order_.push_back(record.get());
  return *record;
}

void SelectiveCache::cache_outputs(
    OpRecord& record,
    int64_t call_index,
    c10::ArrayRef<c10::IValue> outputs,
    Policy decision) {
  // Built apart and committed at the end: an offload that raises (the host
  // cap) leaves the call to recompute, never half cached.
  Entry& entry = record.entries[call_index];
  auto cached = std::make_unique<CachedOutputs>();
  std::vector<const c10::StorageImpl*> storages;
  cached->outputs.reserve(outputs.size());
  const bool offload = is_offload(decision);
  const offload::OffloadOptions options = offload ? offload::options() : offload::OffloadOptions();
  const bool must = decision == Policy::MustOffload;
  const c10::ArrayRef<InputSeen> inputs(inputs_seen_.data() + entry.inputs_begin, entry.num_inputs);
  const auto new_storage = [&](const at::Tensor& t) {
    // `_unsafe_view` declares no alias but returns its input's storage.
    const c10::StorageImpl* st = storage_of(t);
    return !record.facts->returns_alias && st != nullptr &&
        std::none_of(inputs.begin(), inputs.end(), [&](const InputSeen& in) {
          return same_storage(in.storage, st);
        });
  };
  for (size_t position = 0; position < outputs.size(); ++position) {
    int32_t element = -1; // the tensor's place in the output, as map_tensors walks it
    cached->outputs.push_back(map_tensors(outputs[position], [&](const at::Tensor& t) {
      ++element;
      if (!t.defined()) {
        return cacheable(t, record.facts->returns_alias);
      }
      // A tensor the op made anew goes to host memory; a view or an
      // ineligible tensor stays on the device (PREFER_OFFLOAD).
      if (offload) {
        if (new_storage(t) && offload::why_not_offloadable(t, options, must) == nullptr) {
          cached->watched.push_back(t.unsafeGetTensorImpl()->version_counter());
          cached->offloaded.push_back(
              {position, element, offload::offload(t, version_of(t), record.facts->name)});
          cached->offloaded_bytes += static_cast<int64_t>(t.storage().nbytes());
          storages.push_back(storage_of(t));
          return at::Tensor(); // filled in by the reload at the cache hit
        }
        ++stats_.offload_fallbacks;
      }
      cached->watched.push_back(t.unsafeGetTensorImpl()->version_counter());
      cached->bytes += tensor_bytes(t);
      if (const c10::StorageImpl* st = storage_of(t)) {
        storages.push_back(st);
      }
      return cacheable(t, record.facts->returns_alias);
    }));
  }
  for (const c10::StorageImpl* st : storages) {
    cached_storages_[st].emplace_back(&record, call_index);
  }
  entry.offloaded = !cached->offloaded.empty();
  if (cached->offloaded.empty()) {
    ++stats_.saved_ops;
  } else {
    ++stats_.offloaded_ops;
  }
  stats_.saved_bytes += cached->bytes;
  stats_.offloaded_bytes += cached->offloaded_bytes;
  entry.cached = std::move(cached);
  entry.state = EntryState::Cached;
}

void SelectiveCache::invalidate(const c10::StorageImpl* storage) {
  auto it = cached_storages_.find(storage);
  if (it == cached_storages_.end()) {
    return;
  }
  for (const auto& [record, call_index] : it->second) {
    Entry& entry = record->entries[call_index];
    if (entry.state != EntryState::Cached) {
      continue;
    }
    entry.state = EntryState::Recompute;
    entry.offloaded = false;
    --(entry.cached->offloaded.empty() ? stats_.saved_ops : stats_.offloaded_ops);
    stats_.saved_bytes -= entry.cached->bytes;
    stats_.offloaded_bytes -= entry.cached->offloaded_bytes;
    entry.cached.reset();
    ++stats_.invalidated_ops;
  }
  cached_storages_.erase(it);
}

void SelectiveCache::watch_aliases(c10::ArrayRef<c10::IValue> outputs) {
  if (cached_storages_.empty()) {
    return;
  }
  for (const c10::IValue& out : outputs) {
    for_each_tensor(out, [&](const at::Tensor& t) {
      auto it = cached_storages_.find(storage_of(t));
      if (it == cached_storages_.end()) {
        return;
      }
      for (const auto& [record, call_index] : it->second) {
        Entry& entry = record->entries[call_index];
        if (entry.state == EntryState::Cached) {
          entry.cached->watched.push_back(t.unsafeGetTensorImpl()->version_counter());
        }
      }
    });
  }
}

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
  // Ops under no_grad in a checkpointed function entered with grad on are
  // seen too, as by PyTorch's SAC: a custom autograd.Function's body, a
  // custom op under its autograd formula.
  if (!cache_->records() || c10::InferenceMode::is_enabled() || interception_paused()) {
    run(stack);
    return;
  }
  SelectiveCache::OpRecord& record = cache_->record_for(op);
  if (record.facts->ignored || record.facts->collective_wait) {
    run(stack);
    return;
  }
  TORCH_CHECK(
      policy_, "torch_sac: ", op_display_name(op),
      " ran in a forward checkpoint "
      "context that was already exited; enter a new pair of contexts per forward.");
  const size_t num_args = record.facts->num_args;
  TORCH_INTERNAL_ASSERT(stack->size() >= num_args);
  const c10::ArrayRef<c10::IValue> args(stack->data() + stack->size() - num_args, num_args);
  // A policy that looks at the inputs sees them after the op ran (torch calls
  // it with op_output), so keep them; in-place ops return their input anyway.
  std::vector<c10::IValue> inputs;
  if (policy_->needs_values()) {
    inputs.assign(args.begin(), args.end());
  }
  const bool draws_now = call_draws_random(*record.facts, args);
  auto& inputs_seen = cache_->inputs_seen_;
  const size_t inputs_begin = inputs_seen.size();
  std::vector<SelectiveCache::StorageWritten> writes;
  uint32_t position = 0;
  const int64_t sequence_position = cache_->forward_ops_;
  for (size_t i = 0; i < num_args; ++i) {
    const bool written = !record.facts->written_args.empty() &&
        std::find(record.facts->written_args.begin(), record.facts->written_args.end(), i) !=
            record.facts->written_args.end();
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      SelectiveCache::InputSeen& input = inputs_seen.emplace_back();
      if (const c10::StorageImpl* s = storage_of(t)) {
        input.storage.emplace(t.storage().getWeakStorageImpl());
        input.version = version_of(t);
        if (written) {
          // A cached output written later in forward is stale: recompute it.
          cache_->invalidate(s);
          writes.push_back({position, input.storage});
          cache_->last_write_[s] = sequence_position;
        }
      }
      ++position;
    });
  }
  const size_t num_inputs = inputs_seen.size() - inputs_begin;
  // An op that writes its arguments is re-run in recompute whatever the
  // policy says, unless it only writes tensors from outside the region
  // (BatchNorm's running statistics) and returns new tensors: a cache hit
  // skips the op, so a write to a tensor recompute makes anew would be lost,
  // and an in-place op returns its `self` to the Python code, not the
  // handler's output.
  bool cacheable_writes = record.facts->written_args.empty() ||
      (!record.facts->returns_written_arg &&
       std::none_of(writes.begin(), writes.end(), [&](const auto& w) {
         return cache_->produced_.count(w.storage->_unsafe_get_target()) > 0;
       }));
  run(stack);
  const size_t num_returns = record.facts->num_returns;
  c10::ArrayRef<c10::IValue> outputs(stack->data() + stack->size() - num_returns, num_returns);
  const c10::ArrayRef<SelectiveCache::InputSeen> seen(
      cache_->inputs_seen_.data() + inputs_begin, num_inputs);
  // New tensors, as the region engine counts them: an output on a storage
  // no argument lives on (`_unsafe_view` declares no alias but returns its
  // input's storage), each storage once.
  bool made_new = false;
  int64_t new_bytes = 0;
  c10::SmallVector<const c10::StorageImpl*, 4> new_storages;
  for (const c10::IValue& out : outputs) {
    for_each_tensor(out, [&](const at::Tensor& t) {
      const c10::StorageImpl* s = storage_of(t);
      if (!s) {
        return;
      }
      cache_->produced_.insert(s);
      if (record.facts->returns_alias ||
          std::find(new_storages.begin(), new_storages.end(), s) != new_storages.end() ||
          std::any_of(seen.begin(), seen.end(), [&](const SelectiveCache::InputSeen& in) {
            return in.storage && in.storage->_unsafe_get_target() == s;
          })) {
        return;
      }
      new_storages.push_back(s);
      made_new = true;
      new_bytes += static_cast<int64_t>(t.storage().nbytes());
    });
  }

  const int64_t call_index = record.forward_calls++;
  const Policy decision = policy_->decide(OpCall{op, inputs, outputs, call_index, adapter_view});
  ++cache_->stats().policy_calls;

  // Calls whose policy raised have no entry of their own: they keep a
  // default one, recomputed.
  auto& entries = record.entries;
  entries.resize(call_index);
  SelectiveCache::Entry& entry = entries.emplace_back();
  entry.signature = signature_of(outputs);
  entry.first_output_sizes = first_output_sizes(outputs);
  entry.inputs_begin = inputs_begin;
  entry.num_inputs = num_inputs;
  entry.writes = std::move(writes);
  entry.position = cache_->forward_ops_++;
  entry.made_new = made_new;
  entry.new_bytes = new_bytes;
  cache_->watch_aliases(outputs);
  if (decision == Policy::MustOffload) {
    check_must_offload(record, seen, outputs);
  }
  if (is_kept(decision) && cacheable_writes && !draws_now) {
    cache_->cache_outputs(record, call_index, outputs, decision);
  }
}

void CachingHandler::check_must_offload(
    const SelectiveCache::OpRecord& record,
    c10::ArrayRef<SelectiveCache::InputSeen> inputs,
    c10::ArrayRef<c10::IValue> outputs) {
  const offload::OffloadOptions options = offload::options();
  for (const c10::IValue& out : outputs) {
    for_each_tensor(out, [&](const at::Tensor& t) {
      const bool on_an_input = std::any_of(
          inputs.begin(), inputs.end(), [&](const SelectiveCache::InputSeen& in) {
            return SelectiveCache::same_storage(in.storage, storage_of(t));
          });
      offload::check_must_offload(
          record.facts->name, t, record.facts->returns_alias || on_an_input, options);
    });
  }
}

CachedHandler::CachedHandler(std::shared_ptr<SelectiveCache> cache, bool allow_cache_entry_mutation)
    : cache_(std::move(cache)), allow_cache_entry_mutation_(allow_cache_entry_mutation) {
  TORCH_CHECK(cache_, "torch_sac: CachedHandler needs a cache");
}

void CachedHandler::check_inputs(
    const SelectiveCache::OpRecord& record,
    int64_t call_index,
    c10::ArrayRef<c10::IValue> inputs) const {
  const SelectiveCache::Entry& entry = record.entries[call_index];
  const int64_t position = entry.position;
  const c10::ArrayRef<SelectiveCache::InputSeen> forward_inputs(
      cache_->inputs_seen_.data() + entry.inputs_begin, entry.num_inputs);
  size_t k = 0;
  bool count_matches = true;
  for (const c10::IValue& v : inputs) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (k >= forward_inputs.size()) {
        count_matches = false;
        return;
      }
      const SelectiveCache::InputSeen& seen = forward_inputs[k++];
      const c10::StorageImpl* s = storage_of(t);
      if (!SelectiveCache::same_storage(seen.storage, s)) {
        return; // not the storage forward read (recompute made it anew)
      }
      // The same storage forward read: recompute must see what forward saw.
      auto written = cache_->last_write_.find(s);
      if (written != cache_->last_write_.end()) {
        // Forward's writes to it are not made again (see below), so it now
        // holds its value after forward's last write: right for a read at
        // or after that write, wrong for a read before it.
        TORCH_CHECK(
            written->second <= position, "torch_sac: ", op_display_name(record.op), " (call ",
            call_index,
            ") read a "
            "tensor in forward that a later op of the checkpointed region (op #",
            written->second,
            ") modified in place, so recompute would read the modified "
            "value. Do not modify tensors from outside the checkpointed function in place "
            "after reading them inside it (an optimizer step, a buffer update), or move "
            "that code out of the checkpointed function.");
        return;
      }
      if (allow_cache_entry_mutation_ && cache_->cached_storages_.count(s)) {
        return;
      }
      const uint32_t now = version_of(t);
      TORCH_CHECK(
          now == seen.version,
          "one of the variables needed for gradient computation has been modified by an "
          "inplace operation: a tensor of shape ",
          t.sizes(), " is at version ", now, "; expected version ", seen.version,
          " instead. (torch_sac: ", op_display_name(record.op), " (call ", call_index,
          ") read it in the "
          "checkpointed region's forward and reads it again in recompute; it was modified "
          "in place in between.)");
    });
  }
  if (k != forward_inputs.size() || !count_matches) {
    recompute_took_other_path(
        record.op, call_index, "ran with a different number of tensor arguments than in forward");
  }
}

void CachedHandler::check_cached_unchanged(
    const SelectiveCache::OpRecord& record,
    int64_t call_index) const {
  const SelectiveCache::CachedOutputs& cached = *record.entries[call_index].cached;
  for (size_t i = 0; i < cached.watched.size(); ++i) {
    const uint32_t cached_version = cached.watched_versions[i];
    const uint32_t now = current_version(cached.watched[i]);
    TORCH_CHECK(
        now == cached_version, "torch_sac: an output of ", op_display_name(record.op), " (call ",
        call_index,
        ") was cached by selective activation checkpointing and then mutated in place "
        "(version ",
        cached_version, " -> ", now,
        ") after forward, so backward would see "
        "wrong values. Make the policy recompute this op, avoid the in-place op, or pass "
        "allow_cache_entry_mutation=True if the mutation is intended.");
  }
}

void CachedHandler::handle(
    const c10::OperatorHandle& op,
    torch::jit::Stack* stack,
    RunOp run,
    const void* /*adapter_view*/) {
  if (!cache_->records() || c10::InferenceMode::is_enabled() || interception_paused()) {
    run(stack);
    return;
  }
  SelectiveCache::OpRecord& record = cache_->record_for(op);
  if (record.facts->ignored || record.facts->collective_wait) {
    run(stack);
    return;
  }
  const int64_t call_index = record.recompute_calls++;
  if (call_index >= static_cast<int64_t>(record.entries.size())) {
    recompute_took_other_path(
        op, call_index,
        record.entries.empty() ? std::string("ran in recompute but never in forward")
                               : "ran in recompute, but forward ran it only " +
                std::to_string(record.entries.size()) + " times");
  }
  SelectiveCache::Entry& entry = record.entries[call_index];
  const size_t num_args = record.facts->num_args;
  TORCH_INTERNAL_ASSERT(stack->size() >= num_args);
  check_inputs(
      record, call_index,
      c10::ArrayRef<c10::IValue>(stack->data() + stack->size() - num_args, num_args));
  auto& stats = cache_->stats();
  switch (entry.state) {
    case SelectiveCache::EntryState::Recompute: {
      // A write forward already made to this very storage goes to a copy.
      if (!entry.writes.empty()) {
        torch::jit::Stack args(stack->end() - num_args, stack->end());
        bool redirected = false;
        for_each_tensor_arg(args, [&](const at::Tensor& t, uint32_t k, auto replace) {
          for (const auto& w : entry.writes) {
            if (w.input == k && SelectiveCache::same_storage(w.storage, storage_of(t))) {
              const ReplayGuard plain_copy;
              replace(t.clone());
              ++stats.redirected_writes;
              redirected = true;
            }
          }
        });
        if (redirected) {
          std::copy(args.begin(), args.end(), stack->end() - num_args);
        }
      }
      const auto start = std::chrono::steady_clock::now();
      run(stack);
      const int64_t elapsed = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now() - start)
                                  .count();
      const size_t num_returns = record.facts->num_returns;
      c10::ArrayRef<c10::IValue> outputs(stack->data() + stack->size() - num_returns, num_returns);
      if (signature_of(outputs) != entry.signature) {
        recompute_outputs_differ(op, call_index, entry.first_output_sizes, outputs);
      }
      ++entry.recomputed;
      ++record.recomputed;
      record.recompute_ns += elapsed;
      ++stats.replayed_ops;
      stats.replay_ns += elapsed;
      return;
    }
    case SelectiveCache::EntryState::Consumed:
      TORCH_CHECK(
          false,
          "Trying to backward an extra time. You are only allowed to backward "
          "once on any region computed under selective activation checkpoint "
          "(torch_sac: the cached output of ",
          op_display_name(op), " call ", call_index, " was already used by an earlier backward).");
    case SelectiveCache::EntryState::Cached:
      break;
  }
  if (!allow_cache_entry_mutation_) {
    check_cached_unchanged(record, call_index);
  }
  torch::jit::drop(*stack, num_args);
  // Versions were checked above, against every alias forward saw (or
  // mutation is allowed, and the host copy holds forward's value).
  auto& cached_outputs = entry.cached->outputs;
  for (const auto& o : entry.cached->offloaded) {
    int32_t element = -1;
    cached_outputs[o.output] = map_tensors(
        cached_outputs[o.output], [&](const at::Tensor& t) -> at::Tensor {
          return ++element == o.element ? o.tensor.reload(/*check_version=*/false) : t;
        });
  }
  for (c10::IValue& out : entry.cached->outputs) {
    stack->push_back(std::move(out));
  }
  entry.cached.reset();
  entry.state = SelectiveCache::EntryState::Consumed;
  ++stats.cache_hits;
}

std::vector<OpSummary> SelectiveCache::summary() const {
  std::vector<OpSummary> out;
  out.reserve(first_seen_order_.size());
  for (const OpRecord* record : first_seen_order_) {
    if (record->facts->ignored || record->facts->collective_wait) {
      continue;
    }
    OpSummary s{record->facts->name};
    s.recomputes_by_call.reserve(record->entries.size());
    for (const Entry& e : record->entries) {
      const bool saved = e.state != EntryState::Recompute;
      if (!(saved && e.offloaded)) {
        (saved ? s.saved : s.dropped) += 1;
      }
      if (e.made_new && e.offloaded && saved) {
        s.offloaded_new += 1;
        s.offloaded_bytes += e.new_bytes;
      } else if (e.made_new) {
        (saved ? s.saved_new : s.dropped_new) += 1;
        (saved ? s.saved_bytes : s.dropped_bytes) += e.new_bytes;
      }
      s.recomputes_by_call.push_back(e.recomputed);
    }
    s.recomputed = record->recomputed;
    s.recompute_ns = record->recompute_ns;
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<std::pair<c10::OperatorHandle, int64_t>> SelectiveCache::saved_calls() const {
  std::vector<std::pair<c10::OperatorHandle, int64_t>> out;
  for (const OpRecord* record : first_seen_order_) {
    const auto& entries = record->entries;
    for (size_t i = 0; i < entries.size(); ++i) {
      if (entries[i].state != EntryState::Recompute) {
        out.emplace_back(record->op, static_cast<int64_t>(i));
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
      cache, std::make_shared<CachingHandler>(cache, std::move(policy)),
      std::make_shared<CachedHandler>(cache, allow_cache_entry_mutation)};
}

} // namespace torch_sac
