// The counting CPU allocator: exact byte counts, peak and windows, tensors
// from before install, copy-on-write, resize, raw buffers, threads.

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/COW.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "csrc/core/counting_allocator.h"

namespace torch_sac {
namespace {

// Made before install by the environment below, freed by a test after it.
struct BeforeInstall {
  c10::Allocator* previous = nullptr;
  std::vector<at::Tensor> tensors;
  void* raw = nullptr;
};
BeforeInstall& before_install() {
  static BeforeInstall b;
  return b;
}

// Installs the counting allocator once per process, before any test, after
// allocating the BeforeInstall objects (each ctest process runs it too).
class InstallEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    auto& b = before_install();
    b.previous = c10::GetCPUAllocator();
    b.tensors = {at::ones({1000}), at::empty({3, 17}, at::kDouble)};
    b.raw = b.previous->raw_allocate(4096);
    install_counting_allocator();
  }
};
const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new InstallEnvironment);

int64_t allocated() {
  return cpu_memory_stats().allocated;
}

TEST(CountingAllocator, InstalledOnceAndInEffect) {
  CountingAllocator* installed = installed_counting_allocator();
  ASSERT_NE(installed, nullptr);
  EXPECT_EQ(c10::GetCPUAllocator(), installed);
  EXPECT_EQ(installed->wrapped(), before_install().previous);
  EXPECT_EQ(install_counting_allocator(), installed); // idempotent
  EXPECT_EQ(c10::GetCPUAllocator(), installed);
}

TEST(CountingAllocator, ExactBytesOfEmpty) {
  const auto base = cpu_memory_stats();
  auto a = at::empty({10, 3}, at::kFloat);
  EXPECT_EQ(allocated() - base.allocated, 120);
  auto b = at::empty({7}, at::kDouble);
  auto c = at::empty({5}, at::kByte);
  auto d = at::empty({4, 0}, at::kFloat); // nothing to allocate
  EXPECT_EQ(allocated() - base.allocated, 120 + 56 + 5);
  EXPECT_EQ(cpu_memory_stats().allocs - base.allocs, 3);
  EXPECT_EQ(a.storage().allocator(), installed_counting_allocator());

  b.reset();
  EXPECT_EQ(allocated() - base.allocated, 120 + 5);
  a.reset();
  c.reset();
  d.reset();
  const auto after = cpu_memory_stats();
  EXPECT_EQ(after.allocated, base.allocated);
  EXPECT_EQ(after.frees - base.frees, 3);
}

TEST(CountingAllocator, ViewsAndInPlaceOpsAllocateNothing) {
  auto a = at::ones({64, 64});
  const int64_t base = allocated();
  auto v = a.t();
  a.mul_(2);
  auto s = a.narrow(0, 1, 10);
  EXPECT_EQ(allocated(), base);
  auto b = a + 1; // a new 64x64 float tensor
  EXPECT_EQ(allocated() - base, 64 * 64 * 4);
}

TEST(CountingAllocator, PeakTracksMaxAndResets) {
  reset_cpu_peak();
  const int64_t base = allocated();
  EXPECT_EQ(cpu_memory_stats().peak, base);
  auto a = at::empty({250}); // 1000 B
  auto b = at::empty({500}); // 2000 B
  a.reset();
  auto c = at::empty({125}); // 500 B
  EXPECT_EQ(cpu_memory_stats().peak - base, 3000);
  EXPECT_EQ(allocated() - base, 2500);
  reset_cpu_peak();
  EXPECT_EQ(cpu_memory_stats().peak - base, 2500);
  b.reset();
  c.reset();
  EXPECT_EQ(cpu_memory_stats().peak - base, 2500);
  EXPECT_EQ(allocated(), base);
}

TEST(CountingAllocator, TensorsFromBeforeInstallAreSafeAndUncounted) {
  auto& b = before_install();
  ASSERT_NE(b.previous, installed_counting_allocator());
  const auto base = cpu_memory_stats();
  // Still working memory, still owned by the previous allocator.
  EXPECT_EQ(b.tensors[0].sum().item<float>(), 1000.0f);
  EXPECT_EQ(b.tensors[0].storage().allocator(), b.previous);
  const auto during = cpu_memory_stats(); // the sum's result came and went
  b.tensors.clear();
  // A raw buffer of the previous allocator, freed through whatever
  // GetAllocator(kCPU) is at free time, as oneDNN's engine allocator does.
  c10::GetAllocator(c10::DeviceType::CPU)->raw_deallocate(b.raw);
  b.raw = nullptr;
  const auto after = cpu_memory_stats();
  EXPECT_EQ(after.allocated, base.allocated);
  EXPECT_EQ(after.frees, during.frees); // nothing of ours was freed
}

TEST(CountingAllocator, RawAllocateAndDeallocate) {
  c10::Allocator* cpu = c10::GetCPUAllocator();
  ASSERT_NE(cpu->raw_deleter(), nullptr);
  const int64_t base = allocated();
  void* raw = cpu->raw_allocate(333);
  EXPECT_EQ(allocated() - base, 333);
  std::memset(raw, 7, 333);
  cpu->raw_deallocate(raw);
  EXPECT_EQ(allocated(), base);
}

TEST(CountingAllocator, CloneFreedThroughItsDeleter) {
  c10::Allocator* cpu = c10::GetCPUAllocator();
  const int64_t base = allocated();
  {
    c10::DataPtr source = cpu->allocate(100);
    std::memset(source.get(), 9, 100);
    c10::DataPtr copy = cpu->clone(source.get(), 100);
    EXPECT_EQ(allocated() - base, 200);
    EXPECT_TRUE(cpu->is_simple_data_ptr(copy));
    EXPECT_EQ(static_cast<const unsigned char*>(copy.get())[99], 9);
  }
  EXPECT_EQ(allocated(), base);
}

TEST(CountingAllocator, CopyOnWriteLazyClone) {
  auto a = at::arange(100, at::kFloat);
  const int64_t base = allocated();
  ASSERT_TRUE(c10::impl::cow::has_simple_data_ptr(*a.storage().unsafeGetStorageImpl()));
  auto b = at::_lazy_clone(a); // shares a's memory until written
  EXPECT_EQ(allocated(), base);
  EXPECT_TRUE(c10::impl::cow::is_cow_data_ptr(b.storage().data_ptr()));
  b.mul_(2); // materializes b: a copy of 400 bytes
  EXPECT_EQ(allocated() - base, 400);
  EXPECT_EQ(a[3].item<float>(), 3.0f);
  EXPECT_EQ(b[3].item<float>(), 6.0f);
  a.add_(1); // last reference: takes the memory back, allocates nothing
  EXPECT_EQ(allocated() - base, 400);
  EXPECT_EQ(a[3].item<float>(), 4.0f);
  b.reset();
  EXPECT_EQ(allocated(), base);
  a.reset();
  EXPECT_EQ(allocated(), base - 400);
}

TEST(CountingAllocator, LazyCloneFreedWithoutMaterializing) {
  const int64_t base = allocated();
  {
    auto a = at::ones({256});
    auto b = at::_lazy_clone(a);
    a.reset(); // b holds the last reference to the shared memory
    EXPECT_EQ(allocated() - base, 1024);
    EXPECT_EQ(b.sum().item<float>(), 256.0f);
  }
  EXPECT_EQ(allocated(), base);
}

TEST(CountingAllocator, ResizeCountsTheNewSize) {
  const int64_t base = allocated();
  auto a = at::empty({10});
  a.resize_({100});
  EXPECT_EQ(allocated() - base, 400);
  a.resize_({5}); // shrinking keeps the storage
  EXPECT_EQ(allocated() - base, 400);
  a.reset();
  EXPECT_EQ(allocated(), base);
}

TEST(CountingAllocator, ConcurrentAllocationsSumCorrectly) {
  constexpr int kThreads = 8;
  constexpr int kIterations = 500;
  const auto base = cpu_memory_stats();
  std::vector<std::vector<at::Tensor>> kept(kThreads);
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      while (!go.load()) {
      }
      for (int i = 0; i < kIterations; ++i) {
        auto scratch = at::empty({i + 1}, at::kByte); // freed at once
        if (i % 10 == t % 10) {
          kept[t].push_back(at::empty({t + 1}, at::kFloat));
        }
      }
    });
  }
  go.store(true);
  for (auto& th : threads) {
    th.join();
  }
  int64_t kept_bytes = 0;
  int64_t kept_count = 0;
  for (int t = 0; t < kThreads; ++t) {
    kept_bytes += static_cast<int64_t>(kept[t].size()) * (t + 1) * 4;
    kept_count += static_cast<int64_t>(kept[t].size());
  }
  const auto mid = cpu_memory_stats();
  EXPECT_EQ(mid.allocated - base.allocated, kept_bytes);
  EXPECT_EQ(mid.allocs - base.allocs, kThreads * kIterations + kept_count);
  EXPECT_EQ(mid.frees - base.frees, kThreads * kIterations);
  EXPECT_GE(mid.peak - base.allocated, kept_bytes);
  kept.clear();
  EXPECT_EQ(allocated(), base.allocated);
}

TEST(PeakWindow, NestsWithoutDisturbingOthers) {
  reset_cpu_peak();
  PeakWindow outer;
  auto a = at::empty({250}); // 1000 B
  int64_t inner_rise = 0;
  {
    PeakWindow inner;
    EXPECT_EQ(inner.start() - outer.start(), 1000);
    auto b = at::empty({125}); // 500 B
    a.reset();
    inner.close();
    inner_rise = inner.peak() - inner.start();
    EXPECT_EQ(inner.current() - inner.start(), -500);
    auto c = at::empty({1000}); // after close: not in inner's peak
    EXPECT_EQ(inner.peak() - inner.start(), 500);
  }
  EXPECT_EQ(inner_rise, 500);
  reset_cpu_peak();                              // the global peak does not move windows
  EXPECT_EQ(outer.peak() - outer.start(), 4500); // b + c, once a was freed
  EXPECT_EQ(outer.current(), outer.start());
  outer.close();
  outer.close(); // idempotent
  EXPECT_FALSE(outer.is_open());
}

TEST(PeakWindow, LimitedNumberOpenAtOnce) {
  std::vector<std::unique_ptr<PeakWindow>> windows;
  for (int i = 0; i < CountingAllocator::kMaxWindows; ++i) {
    windows.push_back(std::make_unique<PeakWindow>());
  }
  EXPECT_THROW(PeakWindow(), c10::Error);
  windows.pop_back();
  EXPECT_NO_THROW(PeakWindow());
}

// A wrapped allocator that records what it was asked to do.
struct RecordingAllocator final : c10::Allocator {
  explicit RecordingAllocator(bool simple) : simple(simple) {}
  bool simple;
  int allocs = 0;
  static std::atomic<int> frees;

  static void free_simple(void* p) {
    ++frees;
    std::free(p);
  }
  static void free_with_guard(void* ctx) {
    ++frees;
    std::free(ctx);
  }
  c10::DataPtr allocate(size_t n) override {
    ++allocs;
    if (simple) {
      void* p = std::malloc(n);
      return {p, p, &free_simple, c10::Device(c10::DeviceType::CPU)};
    }
    // Data 16 bytes into the block, like the mobile allocator's guard.
    void* block = std::malloc(n + 16);
    return {
        static_cast<char*>(block) + 16, block, &free_with_guard, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return simple ? &free_simple : nullptr;
  }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
std::atomic<int> RecordingAllocator::frees{0};

TEST(CountingAllocatorInstance, DeleterBoundAtAllocationFreesThroughWrapped) {
  for (bool simple : {true, false}) {
    SCOPED_TRACE(simple ? "simple" : "guarded");
    RecordingAllocator inner(simple);
    CountingAllocator counting(&inner);
    const int frees_before = RecordingAllocator::frees.load();
    {
      c10::DataPtr p = counting.allocate(48);
      EXPECT_EQ(inner.allocs, 1);
      EXPECT_EQ(counting.stats().allocated, 48);
      EXPECT_EQ(counting.is_simple_data_ptr(p), simple);
      EXPECT_EQ(counting.raw_deleter() != nullptr, simple);
      c10::DataPtr q = counting.allocate(16);
      EXPECT_EQ(counting.stats().allocated, 64);
      EXPECT_EQ(counting.stats().peak, 64);
    }
    EXPECT_EQ(RecordingAllocator::frees.load() - frees_before, 2);
    const auto s = counting.stats();
    EXPECT_EQ(s.allocated, 0);
    EXPECT_EQ(s.peak, 64);
    EXPECT_EQ(s.allocs, 2);
    EXPECT_EQ(s.frees, 2);
  }
}

TEST(CountingAllocatorInstance, ZeroBytesAllocateNothing) {
  RecordingAllocator inner(true);
  CountingAllocator counting(&inner);
  // malloc(0) may return a pointer or null; either way the count is 0 bytes.
  {
    c10::DataPtr p = counting.allocate(0);
    EXPECT_EQ(counting.stats().allocated, 0);
  }
  EXPECT_EQ(counting.stats().allocated, 0);
}

} // namespace
} // namespace torch_sac
