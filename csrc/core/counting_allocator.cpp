#include "csrc/core/counting_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

// Representation of the DataPtrs we hand out
// -----------------------------------------
// The obvious design, a context object {wrapped DataPtr, nbytes} with a
// deleter that uncounts and frees, makes every DataPtr "non-simple"
// (context != data), and torch treats those differently:
//  - Copy-on-write: c10::impl::cow::lazy_clone_storage only wraps simple
//    DataPtrs (context == data, or allocator->is_simple_data_ptr()); for any
//    other context it returns null and torch._lazy_clone raises. Materializing
//    the last COW reference asserts that the original context == data and
//    rebuilds a DataPtr with data as context, so is_simple_data_ptr() cannot
//    simply claim simplicity for a context object either.
//  - Allocator::raw_allocate() asserts context == data, and raw_deallocate()
//    calls raw_deleter()(ptr) with the data pointer alone. oneDNN's engine
//    allocator (ATen/native/mkldnn/IDeepRegistration.cpp) does both through
//    c10::GetAllocator(kCPU) looked up at each call, so raw buffers allocated
//    before install are freed through *our* raw_deleter, with a pointer we
//    never handed out.
// A size header in front of the data breaks on those foreign pointers too
// (there is no header in front of them to read).
//
// So when the wrapped allocator's DataPtr is simple (the default CPU
// allocator's always is) ours is simple as well: the same data pointer as
// context, with delete_counted as deleter. delete_counted finds the size and
// the wrapped allocator's deleter (bound at allocation time) in a sharded
// table keyed by pointer. A pointer not in the table came from the wrapped
// allocator before install and goes to its raw deleter. Resizing
// (resize_bytes_cpu allocates anew through storage->allocator() and copies),
// Allocator::clone, pickling (which copies the bytes out) and share_memory_()
// (which moves the bytes into a new MapAllocator storage and frees ours) only
// use allocate() and the deleter and work unchanged.
//
// Only when the wrapped allocator itself returns a non-simple DataPtr (e.g.
// the mobile allocator's guard bytes) do we fall back to a context object;
// lazy clones of those then fall back to whatever torch does for non-simple
// storages.

namespace torch_sac {

struct CountingAllocatorAccess {
  static void on_free(CountingAllocator& allocator, size_t nbytes, uint64_t serial) {
    allocator.on_free(nbytes, serial);
  }
};

namespace {

struct LiveBlock {
  CountingAllocator* owner = nullptr;
  size_t nbytes = 0;
  c10::DeleterFnPtr deleter = nullptr; // the wrapped allocator's
  uint64_t serial = 0;
};

class LiveBlockTable {
 public:
  // Returns the entry it replaced, if `ptr` was already present: a block of
  // ours that was freed behind our back (by a deleter captured before
  // install) and whose address malloc handed out again.
  std::optional<LiveBlock> insert(void* ptr, const LiveBlock& block) {
    Shard& s = shard(ptr);
    std::lock_guard<std::mutex> lock(s.mutex);
    auto [it, inserted] = s.blocks.try_emplace(ptr, block);
    if (inserted) {
      return std::nullopt;
    }
    LiveBlock stale = it->second;
    it->second = block;
    return stale;
  }

  bool take(void* ptr, LiveBlock* out) {
    Shard& s = shard(ptr);
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.blocks.find(ptr);
    if (it == s.blocks.end()) {
      return false;
    }
    *out = it->second;
    s.blocks.erase(it);
    return true;
  }

 private:
  static constexpr int kShardBits = 6;
  struct alignas(64) Shard {
    std::mutex mutex;
    std::unordered_map<void*, LiveBlock> blocks;
  };
  Shard& shard(const void* ptr) {
    // Allocations are 64-byte aligned: drop those bits, then mix.
    const uint64_t h = (reinterpret_cast<uintptr_t>(ptr) >> 6) * 0x9E3779B97F4A7C15ull;
    return shards_[h >> (64 - kShardBits)];
  }
  std::array<Shard, size_t{1} << kShardBits> shards_;
};

LiveBlockTable& live_blocks() {
  // Leaked on purpose: tensors are still freed during interpreter and static
  // teardown, possibly after a function-local static would be destroyed.
  static auto* table = new LiveBlockTable();
  return *table;
}

// The raw deleter of the allocator the installed CountingAllocator wraps:
// frees raw buffers it handed out before install (see the note above).
std::atomic<c10::DeleterFnPtr> g_foreign_deleter{nullptr};
std::atomic<CountingAllocator*> g_installed{nullptr};

void delete_counted(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  LiveBlock block;
  if (live_blocks().take(ptr, &block)) {
    CountingAllocatorAccess::on_free(*block.owner, block.nbytes, block.serial);
    block.deleter(ptr);
    return;
  }
  // Unreachable unless the wrapped allocator has a raw deleter (otherwise
  // ours advertises none); failing here terminates (deleters are noexcept).
  const c10::DeleterFnPtr foreign = g_foreign_deleter.load();
  TORCH_INTERNAL_ASSERT(
      foreign != nullptr, "torch_sac counting allocator: asked to free ", ptr,
      ", which it did not allocate");
  foreign(ptr);
}

// For wrapped allocators whose DataPtrs are not simple.
struct WrappedContext {
  CountingAllocator* owner;
  size_t nbytes;
  c10::DataPtr inner;
  uint64_t serial;
};

void delete_wrapped(void* ctx) {
  auto* wrapped = static_cast<WrappedContext*>(ctx);
  CountingAllocatorAccess::on_free(*wrapped->owner, wrapped->nbytes, wrapped->serial);
  delete wrapped; // frees `inner` through the wrapped allocator's deleter
}

void raise_to(std::atomic<int64_t>& value, int64_t candidate) {
  int64_t current = value.load();
  while (current < candidate && !value.compare_exchange_weak(current, candidate)) {
  }
}

CountingAllocator& require_installed() {
  CountingAllocator* installed = g_installed.load();
  TORCH_CHECK(
      installed != nullptr,
      "torch_sac: the counting CPU allocator is not installed; call "
      "torch_sac.memory.install_counting_allocator() (C++: "
      "torch_sac::install_counting_allocator()) first");
  return *installed;
}

} // namespace

CountingAllocator::CountingAllocator(c10::Allocator* wrapped) : wrapped_(wrapped) {
  TORCH_CHECK(wrapped != nullptr, "CountingAllocator: no allocator to wrap");
}

c10::DataPtr CountingAllocator::allocate(size_t nbytes) {
  c10::DataPtr inner = wrapped_->allocate(nbytes);
  void* data = inner.get();
  const c10::Device device = inner.device();
  if (data == nullptr && inner.get_context() == nullptr) {
    // Nothing allocated (nbytes == 0); keep raw_deleter()'s promise.
    return c10::DataPtr(nullptr, nullptr, &delete_counted, device);
  }
  if (data == inner.get_context()) {
    // Insert first: if it throws, `inner` still frees the memory. The serial
    // is set before anyone can free the block (it is ours until returned).
    LiveBlock block{this, nbytes, inner.get_deleter()};
    block.serial = on_alloc(nbytes);
    if (auto stale = live_blocks().insert(data, block)) {
      CountingAllocatorAccess::on_free(*stale->owner, stale->nbytes, stale->serial);
    }
    inner.release_context();
    return c10::DataPtr(data, data, &delete_counted, device);
  }
  auto ctx = std::make_unique<WrappedContext>(WrappedContext{this, nbytes, std::move(inner), 0});
  ctx->serial = on_alloc(nbytes);
  return c10::DataPtr(data, ctx.release(), &delete_wrapped, device);
}

c10::DeleterFnPtr CountingAllocator::raw_deleter() const {
  // A wrapped allocator with a raw deleter returns simple DataPtrs
  // (raw_allocate asserts it), so ours all carry delete_counted.
  return wrapped_->raw_deleter() != nullptr ? &delete_counted : nullptr;
}

bool CountingAllocator::is_simple_data_ptr(const c10::DataPtr& data_ptr) const {
  return data_ptr.get() == data_ptr.get_context();
}

void CountingAllocator::copy_data(void* dest, const void* src, size_t count) const {
  // Both point into memory the wrapped allocator handed out.
  wrapped_->copy_data(dest, src, count);
}

CpuMemoryStats CountingAllocator::stats() const {
  CpuMemoryStats s;
  s.allocated = allocated_.load();
  s.peak = peak_.load();
  s.allocs = allocs_.load();
  s.frees = frees_.load();
  return s;
}

void CountingAllocator::reset_peak() {
  peak_.store(allocated_.load());
}

uint64_t CountingAllocator::on_alloc(size_t nbytes) {
  const auto serial = static_cast<uint64_t>(allocs_.fetch_add(1));
  const auto n = static_cast<int64_t>(nbytes);
  const int64_t now = allocated_.fetch_add(n) + n;
  raise_to(peak_, now);
  for (uint64_t open = open_windows_.load(); open != 0; open &= open - 1) {
    const int slot = std::countr_zero(open);
    raise_to(window_peaks_[slot], now);
    if (serial >= window_first_serial_[slot].load()) {
      window_retained_[slot].fetch_add(n);
    }
  }
  return serial;
}

void CountingAllocator::on_free(size_t nbytes, uint64_t serial) {
  frees_.fetch_add(1);
  const auto n = static_cast<int64_t>(nbytes);
  allocated_.fetch_sub(n);
  for (uint64_t open = open_windows_.load(); open != 0; open &= open - 1) {
    const int slot = std::countr_zero(open);
    if (serial >= window_first_serial_[slot].load()) {
      window_retained_[slot].fetch_sub(n);
    }
  }
}

int CountingAllocator::open_window(int64_t* start) {
  uint64_t open = open_windows_.load();
  int slot = 0;
  do {
    TORCH_CHECK(
        open != ~uint64_t{0}, "torch_sac: more than ", kMaxWindows,
        " memory measurement windows open at once");
    slot = std::countr_one(open);
  } while (!open_windows_.compare_exchange_weak(open, open | (uint64_t{1} << slot)));
  // A previous owner's value may linger; allocations that already see the
  // slot open may have raised it just now, hence store, then raise.
  *start = allocated_.load();
  window_peaks_[slot].store(*start);
  raise_to(window_peaks_[slot], allocated_.load());
  window_retained_[slot].store(0);
  window_first_serial_[slot].store(static_cast<uint64_t>(allocs_.load()));
  return slot;
}

int64_t CountingAllocator::window_peak(int slot) const {
  return window_peaks_[slot].load();
}

int64_t CountingAllocator::window_retained(int slot) const {
  return window_retained_[slot].load();
}

void CountingAllocator::close_window(int slot) {
  // Until the next owner sets it: allocations racing with that opening are
  // not counted.
  window_first_serial_[slot].store(~uint64_t{0});
  open_windows_.fetch_and(~(uint64_t{1} << slot));
}

CountingAllocator* install_counting_allocator(uint8_t priority) {
  static std::mutex install_mutex;
  std::lock_guard<std::mutex> lock(install_mutex);
  if (CountingAllocator* installed = g_installed.load()) {
    return installed;
  }
  c10::Allocator* current = c10::GetCPUAllocator();
  // Leaked on purpose: SetCPUAllocator takes no ownership, and every storage
  // allocated through it keeps a pointer to it for its whole life.
  auto counting = std::make_unique<CountingAllocator>(current);
  g_foreign_deleter.store(current->raw_deleter());
  c10::SetCPUAllocator(counting.get(), priority);
  if (c10::GetCPUAllocator() != counting.get()) {
    g_foreign_deleter.store(nullptr);
    TORCH_CHECK(
        false,
        "torch_sac: could not install the counting CPU allocator: "
        "c10::SetCPUAllocator kept the current allocator, which was installed "
        "with a priority above ",
        static_cast<int>(priority));
  }
  g_installed.store(counting.get());
  return counting.release();
}

CountingAllocator* installed_counting_allocator() {
  return g_installed.load();
}

CpuMemoryStats cpu_memory_stats() {
  return require_installed().stats();
}

void reset_cpu_peak() {
  require_installed().reset_peak();
}

PeakWindow::PeakWindow() : PeakWindow(require_installed()) {}

PeakWindow::PeakWindow(CountingAllocator& allocator)
    : allocator_(allocator), slot_(allocator.open_window(&start_)) {}

PeakWindow::~PeakWindow() {
  close();
}

int64_t PeakWindow::peak() const {
  if (slot_ < 0) {
    return closed_peak_;
  }
  return std::max(start_, allocator_.window_peak(slot_));
}

int64_t PeakWindow::retained() const {
  return slot_ < 0 ? closed_retained_ : allocator_.window_retained(slot_);
}

int64_t PeakWindow::current() const {
  return slot_ < 0 ? closed_current_ : allocator_.allocated_.load();
}

void PeakWindow::close() {
  if (slot_ < 0) {
    return;
  }
  closed_current_ = allocator_.allocated_.load();
  closed_peak_ = std::max(peak(), closed_current_);
  closed_retained_ = allocator_.window_retained(slot_);
  allocator_.close_window(slot_);
  slot_ = -1;
}

} // namespace torch_sac
