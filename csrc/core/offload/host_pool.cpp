#include "csrc/core/offload/host_pool.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>

#include "csrc/core/replay_guard.h"

namespace torch_sac::offload {
namespace {

int64_t round_up(int64_t n, int64_t to) {
  return (n + to - 1) / to * to;
}

std::string mib(int64_t bytes) {
  if (bytes < (int64_t{1} << 20)) {
    return std::to_string(bytes) + " bytes";
  }
  return std::to_string((bytes + (1 << 19)) >> 20) + " MiB";
}

} // namespace

HostPool::HostPool(bool pinned) : pinned_(pinned) {}

HostPool::~HostPool() {
  // Copies still reading or writing a range must end before its chunk goes.
  for (Returned& r : returned_) {
    r.in_use_until.synchronize();
  }
}

at::Tensor HostPool::allocate_chunk(int64_t nbytes) const {
  const ReplayGuard not_intercepted; // the pool's own memory, never recorded
  if (pinned_) {
    return at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  }
  // The CPU stand-in: outside the CPU allocator, so that what is offloaded
  // leaves the count of the "device" (the counting CPU allocator).
  void* memory = std::malloc(static_cast<size_t>(nbytes));
  TORCH_CHECK_WITH(
      OutOfMemoryError, memory != nullptr, "torch_sac: offload could not allocate ", mib(nbytes),
      " of host memory.");
  return at::from_blob(
      memory, {nbytes}, [](void* p) { std::free(p); }, at::TensorOptions().dtype(at::kByte));
}

std::optional<HostRange> HostPool::fit(int64_t nbytes) {
  int32_t best_chunk = -1;
  std::map<int64_t, int64_t>::iterator best;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    Chunk& chunk = chunks_[c];
    if (!chunk.memory.defined()) {
      continue;
    }
    for (auto it = chunk.free.begin(); it != chunk.free.end(); ++it) {
      if (it->second >= nbytes && (best_chunk < 0 || it->second < best->second)) {
        best_chunk = static_cast<int32_t>(c);
        best = it;
      }
    }
  }
  if (best_chunk < 0) {
    return std::nullopt;
  }
  Chunk& chunk = chunks_[best_chunk];
  const HostRange range{best_chunk, best->first, nbytes, nbytes};
  const int64_t rest = best->second - nbytes;
  chunk.free.erase(best);
  if (rest > 0) {
    chunk.free.emplace(range.offset + nbytes, rest);
  }
  chunk.used += nbytes;
  return range;
}

HostRange HostPool::allocate(int64_t nbytes, int64_t limit_bytes) {
  TORCH_CHECK(nbytes >= 0, "torch_sac: HostPool::allocate of ", nbytes, " bytes");
  const int64_t size = round_up(std::max<int64_t>(nbytes, 1), kAlignment);
  std::lock_guard<std::mutex> lock(mutex_);
  const auto at_cap = [&](int64_t bytes) {
    TORCH_CHECK_WITH(
        OutOfMemoryError, false, "torch_sac: offloading a tensor of ", mib(nbytes),
        " would take the host memory for offloaded activations past its cap of ", mib(limit_bytes),
        " (", mib(stats_.in_use_bytes), " in use, ", mib(bytes),
        " needed). Raise the cap with torch_sac.offload.set_options(host_limit_bytes=...), "
        "offload fewer ops, or recompute some of them.");
  };
  if (limit_bytes >= 0 && stats_.in_use_bytes + size > limit_bytes) {
    at_cap(stats_.in_use_bytes + size);
  }
  collect_returned(/*wait=*/false);
  std::optional<HostRange> range = fit(size);
  if (!range && limit_bytes >= 0 && stats_.reserved_bytes + size > limit_bytes) {
    // Growing would pass the cap: first the ranges whose copies are still
    // running, then the chunks nothing uses.
    collect_returned(/*wait=*/true);
    range = fit(size);
    if (!range) {
      trim_locked();
      if (stats_.reserved_bytes + size > limit_bytes) {
        at_cap(stats_.reserved_bytes + size); // in use, but fragmented
      }
    }
  }
  if (!range) {
    // A new chunk: at least kChunkBytes, as room under the cap allows.
    const int64_t room = limit_bytes < 0 ? INT64_MAX : limit_bytes - stats_.reserved_bytes;
    const int64_t chunk_bytes = std::max(size, std::min(kChunkBytes, room));
    Chunk chunk;
    chunk.memory = allocate_chunk(chunk_bytes);
    chunk.nbytes = chunk_bytes;
    chunk.free.emplace(0, chunk_bytes);
    // Reuse the slot of a trimmed chunk, so ranges' chunk indices stay valid.
    auto slot = std::find_if(chunks_.begin(), chunks_.end(), [](const Chunk& c) {
      return !c.memory.defined();
    });
    if (slot == chunks_.end()) {
      chunks_.push_back(std::move(chunk));
    } else {
      *slot = std::move(chunk);
    }
    stats_.reserved_bytes += chunk_bytes;
    stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
    ++stats_.chunks_allocated;
    range = fit(size);
    TORCH_INTERNAL_ASSERT(range, "a new chunk must fit the request");
  }
  range->nbytes = nbytes;
  stats_.in_use_bytes += range->size;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  ++stats_.ranges_allocated;
  return *range;
}

void HostPool::free_range(const HostRange& range) {
  Chunk& chunk = chunks_[range.chunk];
  chunk.used -= range.size;
  int64_t offset = range.offset;
  int64_t nbytes = range.size;
  auto next = chunk.free.lower_bound(offset);
  if (next != chunk.free.end() && next->first == offset + nbytes) {
    nbytes += next->second;
    next = chunk.free.erase(next);
  }
  if (next != chunk.free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      nbytes += prev->second;
      chunk.free.erase(prev);
    }
  }
  chunk.free.emplace(offset, nbytes);
}

void HostPool::release(const HostRange& range, std::optional<c10::Event> in_use_until) {
  if (!range.valid()) {
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.in_use_bytes -= range.size;
  if (in_use_until && !in_use_until->query()) {
    returned_.push_back({range, std::move(*in_use_until)});
    return;
  }
  free_range(range);
}

void HostPool::collect_returned(bool wait) {
  auto done = [&](Returned& r) {
    if (wait) {
      r.in_use_until.synchronize();
    } else if (!r.in_use_until.query()) {
      return false;
    }
    free_range(r.range);
    return true;
  };
  returned_.erase(std::remove_if(returned_.begin(), returned_.end(), done), returned_.end());
}

at::Tensor HostPool::bytes(const HostRange& range) const {
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_INTERNAL_ASSERT(range.valid() && chunks_[range.chunk].memory.defined());
  const ReplayGuard not_intercepted;
  return chunks_[range.chunk].memory.narrow(0, range.offset, range.nbytes);
}

void HostPool::trim() {
  std::lock_guard<std::mutex> lock(mutex_);
  collect_returned(/*wait=*/false);
  trim_locked();
}

void HostPool::trim_locked() {
  for (Chunk& chunk : chunks_) {
    if (chunk.memory.defined() && chunk.used == 0) {
      stats_.reserved_bytes -= chunk.nbytes;
      chunk = Chunk();
    }
  }
}

HostPoolStats HostPool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void HostPool::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_in_use_bytes = stats_.in_use_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

} // namespace torch_sac::offload
