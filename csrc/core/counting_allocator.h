#pragma once
// A CPU allocator that counts the bytes live through it and their peak.
//
// CPU torch keeps no allocator statistics, so torch_sac measures activation
// memory by installing a CountingAllocator in front of the CPU allocator in
// effect (c10::SetCPUAllocator). Only tensor data allocated through
// c10::GetCPUAllocator() after install is counted; see docs/design.md,
// "Measuring memory", for what bypasses it.
//
// Counts are exact requested sizes (nbytes passed to allocate()), not what
// malloc rounds them up to.

#include <c10/core/Allocator.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace torch_sac {

struct CpuMemoryStats {
  int64_t allocated = 0; // bytes live now
  int64_t peak = 0;      // max of `allocated` since install or reset_peak()
  int64_t allocs = 0;    // allocate() calls that returned memory
  int64_t frees = 0;     // of those, how many were freed
};

class CountingAllocator final : public c10::Allocator {
 public:
  // Peak windows open at once, per allocator (see PeakWindow).
  static constexpr int kMaxWindows = 64;

  // `wrapped` does the real work and must outlive this allocator and every
  // allocation made through it (allocators are static in practice).
  explicit CountingAllocator(c10::Allocator* wrapped);
  CountingAllocator(const CountingAllocator&) = delete;
  CountingAllocator& operator=(const CountingAllocator&) = delete;

  c10::DataPtr allocate(size_t nbytes) override;
  c10::DeleterFnPtr raw_deleter() const override;
  bool is_simple_data_ptr(const c10::DataPtr& data_ptr) const override;
  void copy_data(void* dest, const void* src, size_t count) const override;

  c10::Allocator* wrapped() const {
    return wrapped_;
  }
  CpuMemoryStats stats() const;
  // Restarts the peak at the bytes live now. Open PeakWindows are unaffected.
  void reset_peak();

 private:
  friend class PeakWindow;
  friend struct CountingAllocatorAccess;

  // on_alloc returns the allocation's serial number, which on_free gets back:
  // a window counts as retained only allocations made while it was open.
  uint64_t on_alloc(size_t nbytes);
  void on_free(size_t nbytes, uint64_t serial);
  // Claims a free slot and starts it at the live bytes, returned in *start.
  int open_window(int64_t* start);
  int64_t window_peak(int slot) const;
  int64_t window_retained(int slot) const;
  void close_window(int slot);

  c10::Allocator* const wrapped_;
  std::atomic<int64_t> allocated_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> allocs_{0};
  std::atomic<int64_t> frees_{0};
  // Bit i set: window slot i is open and window_peaks_[i] is kept up to date.
  std::atomic<uint64_t> open_windows_{0};
  std::array<std::atomic<int64_t>, kMaxWindows> window_peaks_{};
  // Per window: the first allocation serial it counts, and the bytes of the
  // allocations from that one on that are still live.
  std::array<std::atomic<uint64_t>, kMaxWindows> window_first_serial_{};
  std::array<std::atomic<int64_t>, kMaxWindows> window_retained_{};
};

// Installs a CountingAllocator wrapping c10::GetCPUAllocator() with
// c10::SetCPUAllocator(…, priority) and returns it. Idempotent: later calls
// return the same allocator.
//
// Permanent: there is no uninstall. Code outside torch_sac frees raw buffers
// through whatever c10::GetAllocator(kCPU) returns at free time (oneDNN's
// engine allocator does), so restoring the previous allocator would hand our
// allocations to a deleter that cannot uncount them, and would also unseat
// any allocator installed on top of ours since. Measurements use deltas and
// PeakWindows instead of install/uninstall.
//
// c10::SetAllocator only takes effect if `priority` >= the priority of the
// allocator in place; if ours is not in effect afterwards this throws.
// Like c10::SetAllocator itself, install is not synchronised with allocations
// on other threads: call it before starting threads that allocate.
CountingAllocator* install_counting_allocator(uint8_t priority = 0);
// The installed allocator, or nullptr before install.
CountingAllocator* installed_counting_allocator();
// Stats of the installed allocator; throws if it is not installed.
CpuMemoryStats cpu_memory_stats();
// reset_peak() of the installed allocator; throws if it is not installed.
void reset_cpu_peak();

// RAII: the peak of live bytes from construction to close() (or
// destruction), without touching the allocator's global peak or other open
// windows, so windows nest and may overlap across threads. Up to
// CountingAllocator::kMaxWindows can be open per allocator.
//
// Allocations racing with opening or closing the window on other threads may
// or may not be reflected in its peak; the peak is exact for allocations
// ordered after the window opened and before it closed.
class PeakWindow {
 public:
  // On the installed allocator; throws if it is not installed.
  PeakWindow();
  explicit PeakWindow(CountingAllocator& allocator);
  ~PeakWindow();
  PeakWindow(const PeakWindow&) = delete;
  PeakWindow& operator=(const PeakWindow&) = delete;

  // Live bytes when the window opened.
  int64_t start() const {
    return start_;
  }
  // Max live bytes since the window opened (absolute, >= start()); frozen at
  // close().
  int64_t peak() const;
  // Live bytes now, or when the window was closed.
  int64_t current() const;
  // Bytes allocated since the window opened that are still live (now, or
  // at close()): unlike current() - start(), never negative and blind to
  // frees of memory allocated before (a zero_grad() inside the window).
  int64_t retained() const;
  bool is_open() const {
    return slot_ >= 0;
  }
  // Releases the window's slot; idempotent.
  void close();

 private:
  CountingAllocator& allocator_;
  int64_t start_ = 0; // before slot_: its initializer writes start_
  int slot_ = -1;
  int64_t closed_peak_ = 0;
  int64_t closed_current_ = 0;
  int64_t closed_retained_ = 0;
};

} // namespace torch_sac
