#pragma once
// Host memory for offloaded activations: a few large chunks, sub-allocated
// and reused from step to step, under a cap the user sets.
//
// Why a pool of our own: page-locked memory costs milliseconds per
// cudaHostAlloc, which would block the very overlap offloading is for, and
// torch's caching host allocator rounds every request up to a power of two
// (a 65 MiB activation takes 128 MiB of pinned memory: the "pinned memory
// exhaustion" users of other offloaders report). Here a chunk is allocated
// once (pinned, through torch's host allocator, for CUDA; plain malloc for
// the CPU stand-in, outside the CPU allocator torch_sac counts, so offloaded
// bytes leave the device's count in CPU tests too) and ranges of it are
// handed out best-fit, 512-byte aligned, and coalesced when returned.
//
// A returned range may still be read by a host-to-device copy: it carries
// that copy's event and is reused only once the event has completed.
//
// Thread-safe: the Offloader (offloader.h) calls it under its own mutex,
// the profiler reads stats() from any thread.

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

namespace torch_sac::offload {

// A range of one chunk.
struct HostRange {
  int32_t chunk = -1;
  int64_t offset = 0;
  int64_t nbytes = 0; // asked for
  int64_t size = 0;   // taken from the chunk (aligned)
  bool valid() const {
    return chunk >= 0;
  }
};

struct HostPoolStats {
  int64_t in_use_bytes = 0;        // handed out now
  int64_t peak_in_use_bytes = 0;   // since the last reset_peak()
  int64_t reserved_bytes = 0;      // in chunks
  int64_t peak_reserved_bytes = 0; // since the last reset_peak()
  int64_t chunks_allocated = 0;    // chunk allocations since start (each a cudaHostAlloc on CUDA)
  int64_t ranges_allocated = 0;    // ranges handed out since start

  // Two pools' figures as one (the peaks add: an upper bound of the
  // combined peak).
  HostPoolStats& operator+=(const HostPoolStats& o) {
    in_use_bytes += o.in_use_bytes;
    peak_in_use_bytes += o.peak_in_use_bytes;
    reserved_bytes += o.reserved_bytes;
    peak_reserved_bytes += o.peak_reserved_bytes;
    chunks_allocated += o.chunks_allocated;
    ranges_allocated += o.ranges_allocated;
    return *this;
  }
};

class HostPool {
 public:
  // `pinned`: page-locked chunks for copies from and to CUDA devices.
  explicit HostPool(bool pinned);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // A range of at least `nbytes`. Raises c10::OutOfMemoryError naming the
  // cap when the ranges in use, or the chunks, would pass `limit_bytes`
  // (-1: no cap), the latter even after waiting for every returned range's
  // copy and freeing unused chunks.
  HostRange allocate(int64_t nbytes, int64_t limit_bytes);
  // The range is free once `in_use_until` (if any) has completed.
  void release(const HostRange& range, std::optional<c10::Event> in_use_until);
  // The range as a uint8 CPU tensor (pinned when the pool is).
  at::Tensor bytes(const HostRange& range) const;

  // Frees the chunks nothing is allocated from (returned ranges whose copy
  // is still running keep theirs).
  void trim();
  HostPoolStats stats() const;
  void reset_peak();
  bool pinned() const {
    return pinned_;
  }

  // Smallest chunk allocated (a larger request gets a chunk of its own size).
  static constexpr int64_t kChunkBytes = int64_t{64} << 20;
  static constexpr int64_t kAlignment = 512;

 private:
  struct Chunk {
    at::Tensor memory; // uint8; undefined once freed by trim()
    int64_t nbytes = 0;
    std::map<int64_t, int64_t> free; // offset -> bytes, coalesced
    int64_t used = 0;                // bytes handed out, or returned but not yet free
  };
  struct Returned {
    HostRange range;
    c10::Event in_use_until;
  };

  std::optional<HostRange> fit(int64_t nbytes);
  void free_range(const HostRange& range);
  // Frees returned ranges whose copy has completed; waits for all of them
  // first when `wait`.
  void collect_returned(bool wait);
  void trim_locked();
  at::Tensor allocate_chunk(int64_t nbytes) const;

  mutable std::mutex mutex_;
  const bool pinned_;
  std::vector<Chunk> chunks_;
  std::vector<Returned> returned_;
  HostPoolStats stats_;
};

} // namespace torch_sac::offload
