#include "csrc/core/offload/offloader.h"

#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "csrc/core/replay_guard.h"
#include "csrc/core/tensor_kind.h"
#include "csrc/core/tensor_version.h"

namespace torch_sac::offload {

// One storage's host copy, and where its bytes are in forward and backward.
// Every field is guarded by the Offloader's mutex.
class OffloadedStorage : public std::enable_shared_from_this<OffloadedStorage> {
 public:
  OffloadedStorage() = default;
  OffloadedStorage(const OffloadedStorage&) = delete;
  OffloadedStorage& operator=(const OffloadedStorage&) = delete;
  ~OffloadedStorage();

  int64_t seq = 0; // offload order
  c10::Device device{c10::kCPU};
  int64_t nbytes = 0;
  std::string op; // the op that made it, for errors
  // Dedupe key: the storage (weakly, so its address cannot be reused
  // unnoticed) and the caller's state.
  const c10::StorageImpl* key = nullptr;
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> identity;
  uint64_t state = 0;
  // The version counter of the tensor first offloaded, and its version then.
  c10::VariableVersion version_counter;
  uint32_t version = 0;
  // Written after it was offloaded (before_write): backward must not take
  // the original, even while someone keeps it alive, and no later offload
  // of the storage may share this copy.
  bool written = false;
  // The first such write found the tensor at its offloaded version: the
  // host copy (made or waited for before that write) holds the offloaded
  // value, so a reload may ignore the version having moved since.
  bool copy_before_writes = false;
  // Recorded on the stream current when it was offloaded (the stream that
  // made it), for a copy out started later (a staged one).
  std::optional<c10::Event> produced;

  enum class Where : uint8_t { Staged, Copying, OnHost };
  Where where = Where::Staged;
  c10::Storage source;           // Staged, Copying: the device storage
  std::optional<c10::Event> d2h; // Copying: the device-to-host copy
  HostRange host;                // Copying, OnHost
  // Backward: the storage reloaded ahead and not yet consumed, the copy into
  // it (or into the last reload), and the last reload once consumed.
  c10::Storage prefetched;
  std::optional<c10::Event> h2d;
  std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> reloaded;
  // Saved tensors of it not yet reloaded; while some are, the last reload
  // stays on the device for them.
  int32_t unconsumed = 0;
  c10::Storage resident;
  bool counted_kept_last = false;
};

namespace {

int64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : -1;
}

OffloadOptions default_options() {
  OffloadOptions o;
  const int64_t ram = physical_memory_bytes();
  o.host_limit_bytes = ram > 0 ? ram / 2 : -1;
  return o;
}

// The whole storage as uint8, below everything the interceptor sees.
at::Tensor storage_bytes(const c10::Storage& storage, c10::Device device) {
  return at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device))
      .set_(storage, 0, {static_cast<int64_t>(storage.nbytes())}, {1});
}

int64_t elapsed_ns(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now() - since)
      .count();
}

enum class Timed : uint8_t { D2H, H2D, Waited };

CopyTimes copy_times(Timed what, int64_t ns) {
  CopyTimes t;
  switch (what) {
    case Timed::D2H:
      t.d2h_ns = ns;
      break;
    case Timed::H2D:
      t.h2d_ns = ns;
      break;
    case Timed::Waited:
      t.waited_ns = ns;
      t.waits = 1;
      break;
  }
  return t;
}

// A copy or a wait timed by two events on one stream, not yet known to have
// completed.
struct PendingTiming {
  std::string op;
  Timed what;
  c10::Event start;
  c10::Event end;
};

// Times the work queued on `stream` between construction and finish() with
// two timing events (a no-op unless `enabled`).
class StreamTimer {
 public:
  StreamTimer(bool enabled, const c10::Stream& stream) : stream_(stream) {
    if (enabled) {
      start_.emplace(stream.device_type(), c10::EventFlag::BACKEND_DEFAULT);
      start_->record(stream);
    }
  }
  void finish(std::string op, Timed what, std::vector<PendingTiming>& pending) {
    if (!start_) {
      return;
    }
    c10::Event end(stream_.device_type(), c10::EventFlag::BACKEND_DEFAULT);
    end.record(stream_);
    pending.push_back({std::move(op), what, std::move(*start_), std::move(end)});
    start_.reset();
  }

 private:
  c10::Stream stream_;
  std::optional<c10::Event> start_;
};

} // namespace

class Offloader {
 public:
  static Offloader& get() {
    // Never destroyed: offloaded tensors may die during interpreter teardown.
    static auto* offloader = new Offloader();
    return *offloader;
  }

  OffloadedTensor offload(const at::Tensor& t, uint64_t state, const std::string& op);
  c10::Storage reload(OffloadedStorage& s, bool* consumed);
  void release_consumer(OffloadedStorage& s);
  // Whether the host copy holds the value offloaded at `version` though the
  // tensor's version moved: every write since was seen (before_write) and
  // ordered after the copy.
  bool host_copy_holds(OffloadedStorage& s, uint32_t version) {
    std::lock_guard<std::mutex> lock(mutex_);
    return s.copy_before_writes && s.version == version &&
        s.where != OffloadedStorage::Where::Staged;
  }
  void before_write(const c10::StorageImpl* storage);
  void forget(OffloadedStorage& s);
  bool active() const {
    return live_count_.load(std::memory_order_relaxed) > 0;
  }
  void prefetch(OffloadedStorage& s);

  OffloadOptions options() {
    std::lock_guard<std::mutex> lock(mutex_);
    return options_;
  }
  void set_options(const OffloadOptions& o) {
    std::lock_guard<std::mutex> lock(mutex_);
    options_ = o;
  }
  OffloadStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    resolve_timings_locked(/*wait=*/false);
    OffloadStats s = stats_;
    s.host = pinned_pool_.stats();
    s.host += stand_in_pool_.stats();
    return s;
  }
  int64_t host_in_use_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return pinned_pool_.stats().in_use_bytes + stand_in_pool_.stats().in_use_bytes;
  }
  std::vector<std::pair<std::string, CopyTimes>> copy_times_by_op() {
    std::lock_guard<std::mutex> lock(mutex_);
    resolve_timings_locked(/*wait=*/false);
    return {copy_times_.begin(), copy_times_.end()};
  }
  void reset_peaks() {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.peak_copying_bytes = stats_.copying_bytes;
    stats_.peak_prefetched_bytes = stats_.prefetched_bytes;
    pinned_pool_.reset_peak();
    stand_in_pool_.reset_peak();
  }
  void synchronize(bool trim);

 private:
  Offloader() : options_(default_options()), pinned_pool_(true), stand_in_pool_(false) {}

  HostPool& pool(c10::DeviceType type) {
    return type == c10::kCPU ? stand_in_pool_ : pinned_pool_;
  }
  c10::Stream copy_stream(c10::Device device);
  // Starts the copy to host memory of a staged storage (no longer staged).
  void copy_out_locked(OffloadedStorage& s);
  c10::Storage copy_in_locked(OffloadedStorage& s);
  void prefetch_before_locked(int64_t seq);
  // Whether a reload of it would need no copy: still on the device, or its
  // original alive and unchanged.
  bool on_device_locked(OffloadedStorage& s);
  // The original storage, alive and unchanged since offloaded, or null.
  c10::intrusive_ptr<c10::StorageImpl> unchanged_original_locked(OffloadedStorage& s);
  void start_prefetch_locked(OffloadedStorage& s);
  c10::Storage take_prefetched_locked(OffloadedStorage& s);
  // Gives a prefetched copy's room back (kept until its copy completed).
  void drop_prefetched_locked(OffloadedStorage& s);
  void poll_locked();
  void add_time_locked(const std::string& op, Timed what, int64_t ns);
  // The CPU stand-in's copy dst <- src, on the compute thread: timed on the
  // host clock, all of it waited.
  void copy_on_this_thread_locked(
      const std::string& op,
      Timed what,
      at::Tensor& dst,
      const at::Tensor& src);
  // Adds the pending timings whose events completed (all of them, waiting,
  // when `wait`).
  void resolve_timings_locked(bool wait);
  void finish_copy_out_locked(OffloadedStorage& s);
  void unstage_locked(OffloadedStorage& s);

  std::mutex mutex_;
  OffloadOptions options_;
  OffloadStats stats_;
  HostPool pinned_pool_;   // CUDA: page-locked chunks (allocated on first use)
  HostPool stand_in_pool_; // the CPU stand-in
  int64_t next_seq_ = 0;
  std::map<int64_t, OffloadedStorage*> live_; // by offload order
  std::unordered_map<const c10::StorageImpl*, OffloadedStorage*> by_storage_;
  std::deque<OffloadedStorage*> staged_;
  int64_t staged_bytes_ = 0;
  std::vector<OffloadedStorage*> copying_;
  std::map<int64_t, OffloadedStorage*> prefetched_; // by offload order
  std::atomic<int64_t> live_count_{0};              // live_.size(), read without the lock
  // Device storages of forgotten copies a stream still reads or writes,
  // kept until the copy's event completes.
  std::vector<std::pair<c10::Storage, c10::Event>> retiring_;
  std::unordered_map<c10::DeviceIndex, c10::Stream> copy_streams_;
  std::vector<PendingTiming> pending_timings_;
  std::map<std::string, CopyTimes> copy_times_; // by op
};

void Offloader::add_time_locked(const std::string& op, Timed what, int64_t ns) {
  const CopyTimes t = copy_times(what, ns);
  stats_.timed += t;
  copy_times_[op] += t;
}

void Offloader::copy_on_this_thread_locked(
    const std::string& op,
    Timed what,
    at::Tensor& dst,
    const at::Tensor& src) {
  const auto start = std::chrono::steady_clock::now();
  dst.copy_(src);
  const int64_t ns = elapsed_ns(start);
  add_time_locked(op, what, ns);
  add_time_locked(op, Timed::Waited, ns);
}

void Offloader::resolve_timings_locked(bool wait) {
  std::vector<PendingTiming> pending = std::exchange(pending_timings_, {});
  size_t i = 0;
  try {
    for (; i < pending.size(); ++i) {
      PendingTiming& p = pending[i];
      if (wait) {
        p.end.synchronize();
      } else if (!p.end.query()) {
        pending_timings_.push_back(std::move(p));
        continue;
      }
      const double ms = p.start.elapsedTime(p.end);
      add_time_locked(p.op, p.what, static_cast<int64_t>(ms * 1e6));
    }
  } catch (...) {
    // A timing that cannot be read (a device error) is dropped; the ones
    // after it stay pending, none is counted twice.
    for (++i; i < pending.size(); ++i) {
      pending_timings_.push_back(std::move(pending[i]));
    }
    throw;
  }
}

c10::Stream Offloader::copy_stream(c10::Device device) {
  auto it = copy_streams_.find(device.index());
  if (it == copy_streams_.end()) {
    const c10::impl::VirtualGuardImpl impl(device.type());
    it = copy_streams_.emplace(device.index(), impl.getStreamFromGlobalPool(device, false)).first;
  }
  return it->second;
}

OffloadedTensor Offloader::offload(const at::Tensor& t, uint64_t state, const std::string& op) {
  OffloadedTensor out;
  out.geometry_ = TensorGeometry::of(t);
  out.version_counter_ = t.unsafeGetTensorImpl()->version_counter();
  out.version_ = version_of(t);
  const c10::Storage& storage = t.storage();
  const c10::StorageImpl* key = storage.unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(mutex_);
  poll_locked();
  if (auto it = by_storage_.find(key); it != by_storage_.end()) {
    OffloadedStorage* s = it->second;
    auto alive = s->identity->lock();
    // A write the caller's state does not count (a list write, one under
    // inference mode) marked it written, or moved the version.
    if (alive.get() == key && s->state == state && !s->written && s->version == out.version_) {
      // Null when its last owner is being destroyed on another thread.
      out.storage_ = s->weak_from_this().lock();
      if (out.storage_) {
        ++s->unconsumed;
        ++stats_.deduplicated;
        return out;
      }
    }
  }
  auto s = std::make_shared<OffloadedStorage>();
  s->seq = next_seq_++;
  s->device = t.device();
  s->nbytes = static_cast<int64_t>(storage.nbytes());
  s->op = op;
  s->key = key;
  s->identity = c10::weak_intrusive_ptr<c10::StorageImpl>(storage.getWeakStorageImpl());
  s->state = state;
  s->version = out.version_;
  s->version_counter = out.version_counter_;
  s->source = storage;
  if (!s->device.is_cpu()) {
    s->produced.emplace(s->device.type());
    s->produced->record(c10::impl::VirtualGuardImpl(s->device.type()).getStream(s->device));
  }
  live_.emplace(s->seq, s.get());
  by_storage_[key] = s.get();
  staged_.push_back(s.get());
  staged_bytes_ += s->nbytes;
  live_count_.fetch_add(1, std::memory_order_relaxed);
  ++stats_.offloaded;
  s->unconsumed = 1;
  out.storage_ = s;
  // The oldest staged ones go to the host, beyond what stays on the device.
  while (!staged_.empty() && staged_bytes_ > options_.keep_last_bytes) {
    copy_out_locked(*staged_.front()); // may raise at the host cap: it stays staged
  }
  return out;
}

void Offloader::unstage_locked(OffloadedStorage& s) {
  auto it = std::find(staged_.begin(), staged_.end(), &s);
  if (it != staged_.end()) {
    staged_.erase(it);
    staged_bytes_ -= s.nbytes;
  }
}

void Offloader::copy_out_locked(OffloadedStorage& s) {
  TORCH_INTERNAL_ASSERT(s.where == OffloadedStorage::Where::Staged);
  const auto start = std::chrono::steady_clock::now();
  HostPool& host_pool = pool(s.device.type());
  s.host = host_pool.allocate(s.nbytes, options_.host_limit_bytes);
  const ReplayGuard not_intercepted;
  at::Tensor dst = host_pool.bytes(s.host);
  const at::Tensor src = storage_bytes(s.source, s.device);
  if (s.device.is_cpu()) {
    copy_on_this_thread_locked(s.op, Timed::D2H, dst, src);
    finish_copy_out_locked(s);
  } else {
    const c10::Stream side = copy_stream(s.device);
    s.produced->block(side); // after the op that made it, on the stream it ran on
    s.produced.reset();
    {
      const c10::StreamGuard on_side(side);
      StreamTimer timer(options_.time_copies, side);
      dst.copy_(src, /*non_blocking=*/true);
      timer.finish(s.op, Timed::D2H, pending_timings_);
    }
    s.d2h.emplace(s.device.type());
    s.d2h->record(side);
    s.where = OffloadedStorage::Where::Copying;
    copying_.push_back(&s);
    stats_.copying_bytes += s.nbytes;
    stats_.peak_copying_bytes = std::max(stats_.peak_copying_bytes, stats_.copying_bytes);
  }
  unstage_locked(s);
  stats_.offloaded_bytes += s.nbytes;
  stats_.d2h_ns += elapsed_ns(start);
}

void Offloader::finish_copy_out_locked(OffloadedStorage& s) {
  if (s.where == OffloadedStorage::Where::Copying) {
    stats_.copying_bytes -= s.nbytes;
  }
  s.where = OffloadedStorage::Where::OnHost;
  s.source = c10::Storage();
  s.d2h.reset();
}

void Offloader::poll_locked() {
  copying_.erase(
      std::remove_if(
          copying_.begin(), copying_.end(),
          [&](OffloadedStorage* s) {
            if (!s->d2h->query()) {
              return false;
            }
            finish_copy_out_locked(*s);
            return true;
          }),
      copying_.end());
  resolve_timings_locked(/*wait=*/false);
  retiring_.erase(
      std::remove_if(
          retiring_.begin(), retiring_.end(), [](const auto& r) { return r.second.query(); }),
      retiring_.end());
}

c10::Storage Offloader::copy_in_locked(OffloadedStorage& s) {
  const auto start = std::chrono::steady_clock::now();
  const ReplayGuard not_intercepted;
  const at::Tensor src = pool(s.device.type()).bytes(s.host);
  // Allocated on the consuming (current) stream, so that the caching
  // allocator orders its reuse after the consumer; the copy stream waits
  // for the allocation instead.
  at::Tensor dst = at::empty({s.nbytes}, at::TensorOptions().dtype(at::kByte).device(s.device));
  if (s.device.is_cpu()) {
    copy_on_this_thread_locked(s.op, Timed::H2D, dst, src);
    s.h2d.reset();
  } else {
    const c10::impl::VirtualGuardImpl impl(s.device.type());
    c10::Event allocated(s.device.type());
    allocated.record(impl.getStream(s.device));
    const c10::Stream side = copy_stream(s.device);
    allocated.block(side);
    {
      const c10::StreamGuard on_side(side);
      StreamTimer timer(options_.time_copies, side);
      dst.copy_(src, /*non_blocking=*/true);
      timer.finish(s.op, Timed::H2D, pending_timings_);
    }
    s.h2d.emplace(s.device.type());
    s.h2d->record(side);
  }
  ++stats_.reloaded;
  stats_.reloaded_bytes += s.nbytes;
  stats_.h2d_ns += elapsed_ns(start);
  return dst.storage();
}

c10::intrusive_ptr<c10::StorageImpl> Offloader::unchanged_original_locked(OffloadedStorage& s) {
  // Written through a recorded op (before_write), or through the tensor's
  // version counter (outside the region, even with mutation allowed): the
  // host copy holds what the op made, the original does not.
  auto original = s.identity->lock();
  if (s.written || !original || static_cast<int64_t>(original->nbytes()) != s.nbytes ||
      current_version(s.version_counter) != s.version) {
    return {};
  }
  return original;
}

bool Offloader::on_device_locked(OffloadedStorage& s) {
  return s.where == OffloadedStorage::Where::Staged || s.resident ||
      (s.reloaded && s.reloaded->use_count() > 0) || unchanged_original_locked(s);
}

void Offloader::start_prefetch_locked(OffloadedStorage& s) {
  s.prefetched = copy_in_locked(s);
  prefetched_.emplace(s.seq, &s);
  ++stats_.prefetched;
  stats_.prefetched_bytes += s.nbytes;
  stats_.peak_prefetched_bytes = std::max(stats_.peak_prefetched_bytes, stats_.prefetched_bytes);
}

c10::Storage Offloader::take_prefetched_locked(OffloadedStorage& s) {
  prefetched_.erase(s.seq);
  stats_.prefetched_bytes -= s.nbytes;
  return std::exchange(s.prefetched, c10::Storage());
}

void Offloader::drop_prefetched_locked(OffloadedStorage& s) {
  c10::Storage storage = take_prefetched_locked(s);
  if (s.h2d && !s.h2d->query()) {
    // The copy into it still runs; the allocator must not hand it out.
    c10::Event done(s.device.type());
    done.record(copy_stream(s.device));
    retiring_.emplace_back(std::move(storage), std::move(done));
  }
}

void Offloader::prefetch_before_locked(int64_t seq) {
  // The window: the storages offloaded just before `seq` (backward's next
  // ones), up to prefetch_bytes with what is prefetched above `seq`. A
  // storage prefetched further down than the window (another graph's, kept
  // alive; or one this backward will not use soon) gives its room back.
  int64_t room = options_.prefetch_bytes;
  for (auto it = prefetched_.lower_bound(seq); it != prefetched_.end(); ++it) {
    room -= it->second->nbytes;
  }
  bool full = false;
  for (auto it = live_.lower_bound(seq); it != live_.begin();) {
    --it;
    if (full && (prefetched_.empty() || prefetched_.begin()->first > it->first)) {
      return; // nothing prefetched further down
    }
    OffloadedStorage& s = *it->second;
    if (!full && s.nbytes <= room) {
      if (s.prefetched) {
        room -= s.nbytes;
      } else if (!on_device_locked(s)) {
        start_prefetch_locked(s);
        room -= s.nbytes;
      }
      continue;
    }
    full = true;
    if (s.prefetched) {
      drop_prefetched_locked(s);
    }
  }
}

c10::Storage Offloader::reload(OffloadedStorage& s, bool* consumed) {
  std::lock_guard<std::mutex> lock(mutex_);
  poll_locked();
  if (!*consumed) {
    *consumed = true;
    --s.unconsumed;
  }
  c10::Storage out;
  if (s.where == OffloadedStorage::Where::Staged) {
    // Among the last offloaded: never left the device (a write in the
    // region would have started its copy, one outside fails the caller's
    // version check).
    out = s.source;
    if (!s.counted_kept_last) {
      s.counted_kept_last = true;
      ++stats_.kept_last;
      stats_.kept_last_bytes += s.nbytes;
    }
  } else if (s.resident) {
    out = s.resident; // reloaded for an earlier saved tensor of it
  } else if (auto original = unchanged_original_locked(s)) {
    // Someone kept the original alive and unchanged: no copy needed.
    out = c10::Storage(std::move(original));
    if (s.prefetched) {
      drop_prefetched_locked(s);
    }
  } else if (s.prefetched) {
    out = take_prefetched_locked(s);
    if (s.h2d && !s.h2d->query()) {
      ++stats_.late;
      stats_.late_bytes += s.nbytes;
    }
  } else if (auto alive = s.reloaded ? s.reloaded->lock() : c10::intrusive_ptr<c10::StorageImpl>();
             alive) {
    out = c10::Storage(std::move(alive)); // another tensor of it was reloaded
  } else {
    // Not started ahead. A copy out still running is on the same stream, so
    // this copy reads the host bytes after it.
    out = copy_in_locked(s);
    ++stats_.late;
    stats_.late_bytes += s.nbytes;
  }
  if (s.h2d && out.unsafeGetStorageImpl() != s.source.unsafeGetStorageImpl()) {
    const c10::Stream consumer = c10::impl::VirtualGuardImpl(s.device.type()).getStream(s.device);
    // The consumer waits, the host does not; the timer sees how long.
    StreamTimer timer(options_.time_copies, consumer);
    s.h2d->block(consumer);
    timer.finish(s.op, Timed::Waited, pending_timings_);
  }
  if (out.unsafeGetStorageImpl() != s.source.unsafeGetStorageImpl()) {
    s.reloaded = c10::weak_intrusive_ptr<c10::StorageImpl>(out.getWeakStorageImpl());
    s.resident = s.unconsumed > 0 ? out : c10::Storage();
  }
  prefetch_before_locked(s.seq);
  return out;
}

void Offloader::release_consumer(OffloadedStorage& s) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (--s.unconsumed == 0) {
    s.resident = c10::Storage();
  }
}

void Offloader::prefetch(OffloadedStorage& s) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (s.prefetched || on_device_locked(s) ||
      stats_.prefetched_bytes + s.nbytes > options_.prefetch_bytes) {
    return;
  }
  start_prefetch_locked(s);
}

void Offloader::before_write(const c10::StorageImpl* storage) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = by_storage_.find(storage);
  if (it == by_storage_.end()) {
    return;
  }
  OffloadedStorage& s = *it->second;
  if (!s.written) {
    s.copy_before_writes = current_version(s.version_counter) == s.version;
  }
  s.written = true;
  if (s.where == OffloadedStorage::Where::Staged) {
    copy_out_locked(s); // ordered before the write on the compute stream
  }
  if (s.where == OffloadedStorage::Where::Copying) {
    const c10::Stream writer = c10::impl::VirtualGuardImpl(s.device.type()).getStream(s.device);
    StreamTimer timer(options_.time_copies, writer);
    s.d2h->block(writer); // the write waits for the copy
    timer.finish(s.op, Timed::Waited, pending_timings_);
  }
}

void Offloader::forget(OffloadedStorage& s) {
  std::lock_guard<std::mutex> lock(mutex_);
  live_.erase(s.seq);
  live_count_.fetch_sub(1, std::memory_order_relaxed);
  if (auto it = by_storage_.find(s.key); it != by_storage_.end() && it->second == &s) {
    by_storage_.erase(it);
  }
  switch (s.where) {
    case OffloadedStorage::Where::Staged:
      unstage_locked(s);
      break;
    case OffloadedStorage::Where::Copying:
      copying_.erase(std::find(copying_.begin(), copying_.end(), &s));
      stats_.copying_bytes -= s.nbytes;
      if (!s.d2h->query()) {
        retiring_.emplace_back(std::move(s.source), std::move(*s.d2h));
      }
      break;
    case OffloadedStorage::Where::OnHost:
      break;
  }
  s.resident = c10::Storage(); // consumed: its copy back completed for the consumer
  if (s.prefetched) {
    drop_prefetched_locked(s);
  }
  if (s.host.valid()) {
    // The range is free again once every copy from or into it completed:
    // all of them ran on this device's copy stream, so an event recorded
    // there now covers them (the pool is shared by every device).
    std::optional<c10::Event> copies_done;
    if (!s.device.is_cpu()) {
      copies_done.emplace(s.device.type());
      copies_done->record(copy_stream(s.device));
    }
    pool(s.device.type()).release(s.host, std::move(copies_done));
  }
}

void Offloader::synchronize(bool trim) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (OffloadedStorage* s : copying_) {
    s->d2h->synchronize();
  }
  for (auto& r : retiring_) {
    r.second.synchronize();
  }
  poll_locked();
  resolve_timings_locked(/*wait=*/true);
  if (trim) {
    pinned_pool_.trim();
    stand_in_pool_.trim();
  }
}

OffloadedStorage::~OffloadedStorage() {
  Offloader::get().forget(*this);
}

const char* why_not_offloadable(const at::Tensor& t, const OffloadOptions& options, bool must) {
  if (!t.defined()) {
    return nullptr;
  }
  if (const char* kind = unrecordable_kind(t)) {
    return kind;
  }
  if (!t.has_storage() || t.layout() != c10::kStrided) {
    return "it has no strided storage of its own";
  }
  const c10::Device device = t.device();
  if (device.is_cpu() && !options.cpu_stand_in) {
    return "it is a CPU tensor (offloading moves CUDA tensors to host memory)";
  }
  if (!device.is_cpu() && !device.is_cuda()) {
    return "offloading supports CUDA tensors only";
  }
  if (!must && static_cast<int64_t>(t.storage().nbytes()) < options.min_bytes) {
    return "its storage is smaller than the offload threshold (min_bytes)";
  }
  return nullptr;
}

void check_must_offload(
    std::string_view op,
    const at::Tensor& t,
    bool on_an_input,
    const OffloadOptions& options) {
  const char* why = on_an_input
      ? "it is a view of an input or an input written in place (offload the op that made the "
        "storage)"
      : why_not_offloadable(t, options, /*must=*/true);
  TORCH_CHECK_VALUE(
      why == nullptr, "torch_sac: the policy returned MUST_OFFLOAD for ", op,
      ", but its output of shape ", t.sizes(), " on ", t.device(), " cannot be offloaded: ", why,
      ". Return PREFER_OFFLOAD (which keeps such outputs on the device) or MUST_SAVE for this "
      "op.");
}

OffloadedTensor::OffloadedTensor(OffloadedTensor&& other) noexcept
    : storage_(std::move(other.storage_)),
      geometry_(std::move(other.geometry_)),
      version_counter_(std::move(other.version_counter_)),
      version_(other.version_),
      consumed_(other.consumed_) {
  other.storage_.reset();
}

OffloadedTensor& OffloadedTensor::operator=(OffloadedTensor&& other) noexcept {
  if (this != &other) {
    release();
    storage_ = std::move(other.storage_);
    other.storage_.reset();
    geometry_ = std::move(other.geometry_);
    version_counter_ = std::move(other.version_counter_);
    version_ = other.version_;
    consumed_ = other.consumed_;
  }
  return *this;
}

OffloadedTensor::~OffloadedTensor() {
  release();
}

void OffloadedTensor::release() {
  if (storage_ && !consumed_) {
    Offloader::get().release_consumer(*storage_);
  }
  storage_.reset(); // may end the storage's copy: after the lock above
}

at::Tensor OffloadedTensor::reload(bool check_version) const {
  const uint32_t now = current_version(version_counter_);
  if (check_version && now != version_) {
    throw_modified_in_place(
        c10::str("a tensor of shape ", c10::IntArrayRef(geometry_.sizes)), now, version_,
        "it was offloaded to host memory for backward, made by " + storage_->op);
  }
  at::Tensor t = geometry_.view_of(Offloader::get().reload(*storage_, &consumed_));
  t.unsafeGetTensorImpl()->set_version_counter(version_counter_);
  return t;
}

OffloadedTensor offload(const at::Tensor& t, uint64_t state, const std::string& op) {
  return Offloader::get().offload(t, state, op);
}

void before_write(const c10::StorageImpl* storage) {
  if (Offloader::get().active()) {
    Offloader::get().before_write(storage);
  }
}

bool active() {
  return Offloader::get().active();
}

bool OffloadedTensor::host_copy_holds_offloaded_value() const {
  return storage_ && Offloader::get().host_copy_holds(*storage_, version_);
}

void OffloadedTensor::prefetch() const {
  Offloader::get().prefetch(*storage_);
}

bool OffloadedTensor::is_of(const c10::StorageImpl* s) const {
  // identity is set once, at creation: no lock needed to read it.
  return storage_ && storage_->key == s && storage_->identity->lock().get() == s;
}

OffloadOptions options() {
  return Offloader::get().options();
}

void set_options(const OffloadOptions& o) {
  TORCH_CHECK_VALUE(
      o.host_limit_bytes == -1 || o.host_limit_bytes > 0,
      "torch_sac.offload: host_limit_bytes must be positive or -1 (no cap), got ",
      o.host_limit_bytes);
  TORCH_CHECK_VALUE(
      o.min_bytes >= 0 && o.prefetch_bytes >= 0 && o.keep_last_bytes >= 0,
      "torch_sac.offload: min_bytes, prefetch_bytes and keep_last_bytes must be >= 0, got ",
      o.min_bytes, ", ", o.prefetch_bytes, " and ", o.keep_last_bytes);
  Offloader::get().set_options(o);
}

OffloadStats stats() {
  return Offloader::get().stats();
}

std::vector<std::pair<std::string, CopyTimes>> copy_times_by_op() {
  return Offloader::get().copy_times_by_op();
}

int64_t host_in_use_bytes() {
  return Offloader::get().host_in_use_bytes();
}

void reset_peaks() {
  Offloader::get().reset_peaks();
}

void synchronize(bool trim) {
  Offloader::get().synchronize(trim);
}

} // namespace torch_sac::offload
