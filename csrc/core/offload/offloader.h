#pragma once
// Offloading saved activations to host memory: the runtime behind the
// OFFLOAD policy outcome, shared by the region engine and the drop-in.
//
// Forward: offload(t) makes (or finds) the host copy of t's storage. New
// copies are staged first: the last `keep_last_bytes` offloaded stay on the
// device, because backward consumes them first and a round trip could not
// be hidden (the last block, the LM head's output). Older ones are copied
// device-to-host on a side stream, after an event on the compute stream,
// into the pinned host pool (host_pool.h); the device storage is released
// when the copy's event has completed (never extended with record_stream).
//
// Backward: reload() hands back the device copy. The first reload of a
// storage starts host-to-device copies of the next storages in forward's
// reverse order, up to `prefetch_bytes` not yet consumed; the consumer's
// stream waits on the copy's event, the host never does. A storage whose
// copy was not started ahead is copied on demand (counted as late).
//
// Exactness: a write to a storage whose copy is staged or running starts or
// waits for that copy first (before_write), so the host copy holds the value
// the offloading op saw; the callers check versions as for saved tensors.
//
// Devices: CUDA, through c10's device-generic streams and events (no CUDA
// headers here). The CPU stand-in (OffloadOptions::cpu_stand_in) offloads
// CPU tensors into a separate pool outside the CPU allocator, with plain
// synchronous copies: CPU tests exercise the bookkeeping and the counted
// memory, GPU runs the streams.
//
// One Offloader per process; thread-safe (backward may run on any thread).

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Storage.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "csrc/core/offload/host_pool.h"
#include "csrc/core/tensor_geometry.h"

namespace torch_sac::offload {

struct OffloadOptions {
  // Host memory offloaded activations may take, in bytes; -1: no cap.
  // Default: half of the machine's physical memory.
  int64_t host_limit_bytes = -1;
  // PREFER_OFFLOAD keeps smaller tensors on the device (a copy's fixed cost
  // outweighs what it frees). MUST_OFFLOAD ignores it.
  int64_t min_bytes = int64_t{1} << 20;
  // Backward's lookahead: bytes reloaded ahead of their first use and not
  // yet consumed, at most.
  int64_t prefetch_bytes = int64_t{256} << 20;
  // The most recently offloaded bytes stay on the device (see above).
  int64_t keep_last_bytes = int64_t{64} << 20;
  // CPU tensors are offloaded to a stand-in host pool (tests, bookkeeping
  // without a GPU). Off: a CPU tensor is not offloadable.
  bool cpu_stand_in = false;
  // Times every copy and every wait of compute on one, with timing events
  // on the device (the profiler turns it on; a few microseconds per copy).
  // The CPU stand-in's copies are timed on the host clock either way.
  bool time_copies = false;
};

// Time spent on the copies of one op's outputs (or of all of them), in
// device time: the copies themselves, and how long compute waited for them
// (a reload not complete when its consumer ran, a write waiting for a copy
// out). On the CPU stand-in the copies run on the compute thread, so all of
// their time is waited. Filled where copies are timed (time_copies, or the
// CPU stand-in).
struct CopyTimes {
  int64_t d2h_ns = 0;
  int64_t h2d_ns = 0;
  int64_t waited_ns = 0;
  int64_t waits = 0; // timed waits (reloads and writes that waited on a copy)

  CopyTimes& operator+=(const CopyTimes& o) {
    d2h_ns += o.d2h_ns;
    h2d_ns += o.h2d_ns;
    waited_ns += o.waited_ns;
    waits += o.waits;
    return *this;
  }
};

struct OffloadStats {
  int64_t offloaded = 0;       // storages given a host copy
  int64_t offloaded_bytes = 0; // bytes copied device-to-host
  int64_t deduplicated = 0;    // offloads of a storage already offloaded (views)
  int64_t kept_last = 0;       // staged storages backward consumed from the device
  int64_t kept_last_bytes = 0;
  int64_t reloaded = 0; // host-to-device copies
  int64_t reloaded_bytes = 0;
  int64_t prefetched = 0; // of which started ahead of their first use
  // Reloads the consumer had to wait for: copied on demand, or started
  // ahead but not complete when first used (GPU only).
  int64_t late = 0;
  int64_t late_bytes = 0;
  int64_t copying_bytes = 0;      // device bytes held for a running device-to-host copy
  int64_t peak_copying_bytes = 0; // since reset_peaks()
  int64_t prefetched_bytes = 0;   // reloaded ahead, not yet consumed
  int64_t peak_prefetched_bytes = 0;
  int64_t d2h_ns = 0; // host time spent issuing copies (CPU stand-in: the copies)
  int64_t h2d_ns = 0;
  CopyTimes timed; // the timed copies and waits, completed ones only
  HostPoolStats host;
};

class OffloadedStorage;

// Why `t` cannot be offloaded under `options`, or nullptr when it can.
// `must`: the size threshold does not apply.
const char* why_not_offloadable(const at::Tensor& t, const OffloadOptions& options, bool must);

// MUST_OFFLOAD for `op` and its output `t`: raises ValueError naming the op
// and why, unless `t` can be offloaded. `on_an_input`: `t` lies on an
// input's storage (a view, an in-place op's result, `_unsafe_view`), which
// the op that made that storage must offload.
void check_must_offload(
    std::string_view op,
    const at::Tensor& t,
    bool on_an_input,
    const OffloadOptions& options);

// A tensor whose storage has a host copy: how it lies on that storage, and
// its version when offloaded. One per saved tensor (move-only): the
// storage's copy back stays on the device while some of them have not been
// reloaded yet (autograd often saves one storage for two nodes).
class OffloadedTensor {
 public:
  OffloadedTensor() = default;
  OffloadedTensor(OffloadedTensor&& other) noexcept;
  OffloadedTensor& operator=(OffloadedTensor&& other) noexcept;
  OffloadedTensor(const OffloadedTensor&) = delete;
  OffloadedTensor& operator=(const OffloadedTensor&) = delete;
  ~OffloadedTensor();

  bool defined() const {
    return storage_ != nullptr;
  }
  // The tensor on its device again, without autograd metadata, sharing the
  // original's version counter. Raises autograd's error if the tensor was
  // modified in place since it was offloaded, unless `check_version` is
  // false (the caller knows the host copy holds the value it needs).
  at::Tensor reload(bool check_version = true) const;
  // Whether the host copy still holds the value offloaded although the
  // tensor was written since: every write came through before_write, after
  // the copy. A replay reading this input may then skip the version check
  // (autograd's own saved tensors may not: autograd would raise).
  bool host_copy_holds_offloaded_value() const;
  // Starts the copy back to the device now, within the prefetch budget (a
  // region that will consume it soon: the drop-in's recompute).
  void prefetch() const;
  // Whether its storage is `storage` (alive).
  bool is_of(const c10::StorageImpl* storage) const;

 private:
  friend OffloadedTensor offload(const at::Tensor& t, uint64_t state, const std::string& op);
  friend class Offloader;
  void release();

  std::shared_ptr<OffloadedStorage> storage_;
  TensorGeometry geometry_;
  c10::VariableVersion version_counter_;
  uint32_t version_ = 0;
  mutable bool consumed_ = false; // reloaded at least once
};

// Offloads `t` (why_not_offloadable(t) must be nullptr). `state` tells
// states of one storage apart (a region's mutation count, or a version):
// tensors of the same storage and state share one host copy. `op` names the
// op that made it, for errors.
OffloadedTensor offload(const at::Tensor& t, uint64_t state, const std::string& op);

// `storage` is about to be written: a copy of it that is staged starts now,
// one that is running is waited for by the current stream, and backward
// will not take the written original for the copy.
void before_write(const c10::StorageImpl* storage);
// Whether any offloaded storage is alive (cheap; no lock): before_write
// has nothing to do otherwise.
bool active();

OffloadOptions options();
// Raises ValueError on a bad value.
void set_options(const OffloadOptions& options);
OffloadStats stats();
// stats().timed per op (the op that made the storage, "aten::mm.default"),
// since the process started.
std::vector<std::pair<std::string, CopyTimes>> copy_times_by_op();
// stats().host.in_use_bytes, cheaply (a profiler reads it at every sample).
int64_t host_in_use_bytes();
void reset_peaks();
// Waits for every running copy (and for the timings of copies and waits,
// when they are timed), and frees unused host chunks when `trim`.
void synchronize(bool trim);

} // namespace torch_sac::offload
