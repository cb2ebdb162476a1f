// The offload runtime on the CPU stand-in: the host pool's ranges, cap and
// reuse; the offloader's staging, dedupe by storage and state, prefetch in
// reverse order, version checks and what it holds when tensors die.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <optional>
#include <vector>

#include "csrc/core/offload/host_pool.h"
#include "csrc/core/offload/offloader.h"

namespace torch_sac::offload {
namespace {

TEST(HostPool, RangesAreAlignedReusedAndCoalesced) {
  HostPool pool(/*pinned=*/false);
  const HostRange a = pool.allocate(100, -1);
  const HostRange b = pool.allocate(1000, -1);
  EXPECT_EQ(a.nbytes, 100);
  EXPECT_EQ(a.size, HostPool::kAlignment);
  EXPECT_EQ(b.offset % HostPool::kAlignment, 0);
  EXPECT_EQ(pool.bytes(b).numel(), 1000);
  EXPECT_EQ(pool.stats().in_use_bytes, 512 + 1024);
  pool.release(a, std::nullopt);
  pool.release(b, std::nullopt);
  EXPECT_EQ(pool.stats().in_use_bytes, 0);
  // Coalesced: one range as large as both fits where they were.
  const HostRange c = pool.allocate(1536, -1);
  EXPECT_EQ(c.chunk, a.chunk);
  EXPECT_EQ(c.offset, 0);
  EXPECT_EQ(pool.stats().chunks_allocated, 1);
  pool.release(c, std::nullopt);
}

TEST(HostPool, CapRaisesOutOfMemoryNamingIt) {
  HostPool pool(/*pinned=*/false);
  const HostRange a = pool.allocate(4096, 8192);
  try {
    pool.allocate(8192, 8192);
    FAIL() << "expected the cap to raise";
  } catch (const c10::OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("cap of 8192 bytes"), std::string::npos) << e.what();
  }
  pool.release(a, std::nullopt);
  EXPECT_NO_THROW(pool.release(pool.allocate(8192, 8192), std::nullopt));
  pool.trim();
  EXPECT_EQ(pool.stats().reserved_bytes, 0);
}

class Offloader : public ::testing::Test {
 protected:
  void SetUp() override {
    previous_ = options();
    OffloadOptions o = previous_;
    o.cpu_stand_in = true;
    o.min_bytes = 0;
    o.keep_last_bytes = 0;
    o.prefetch_bytes = int64_t{1} << 30;
    set_options(o);
  }
  void TearDown() override {
    set_options(previous_);
    EXPECT_EQ(stats().host.in_use_bytes, 0) << "a host range outlived its tensors";
  }
  OffloadOptions previous_;
};

TEST_F(Offloader, RoundTripIsExactAndLeavesTheDevice) {
  const at::Tensor t = at::randn({64, 32});
  const at::Tensor expected = t.clone();
  const int64_t before = stats().offloaded_bytes;
  {
    OffloadedTensor off = offload(t.t(), /*state=*/0, "aten::test");
    EXPECT_EQ(stats().offloaded_bytes - before, 64 * 32 * 4);
    const at::Tensor back = off.reload();
    EXPECT_TRUE(at::equal(back, expected.t()));
    EXPECT_EQ(back.strides(), t.t().strides());
  }
}

TEST_F(Offloader, ViewsOfOneStorageShareOneCopy) {
  const at::Tensor t = at::randn({8, 8});
  const int64_t copies = stats().offloaded;
  OffloadedTensor a = offload(t.narrow(0, 0, 4), 0, "aten::test");
  OffloadedTensor b = offload(t.narrow(0, 4, 4), 0, "aten::test");
  EXPECT_EQ(stats().offloaded - copies, 1);
  // Another state of the storage is another copy.
  OffloadedTensor c = offload(t, 1, "aten::test");
  EXPECT_EQ(stats().offloaded - copies, 2);
  EXPECT_TRUE(at::equal(b.reload(), t.narrow(0, 4, 4)));
}

TEST_F(Offloader, InPlaceWriteAfterOffloadIsCaught) {
  at::Tensor t = at::randn({16});
  OffloadedTensor off = offload(t, 0, "aten::test");
  t.add_(1);
  try {
    off.reload();
    FAIL() << "expected the version check to raise";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("aten::test"), std::string::npos) << e.what();
  }
  // The caller that knows better (the drop-in with mutation allowed).
  EXPECT_NO_THROW(off.reload(/*check_version=*/false));
}

TEST_F(Offloader, ReloadsPrefetchEarlierOnesWithinTheWindow) {
  OffloadOptions o = options();
  o.prefetch_bytes = 2 * 1024 * 4;
  set_options(o);
  std::vector<OffloadedTensor> offloaded;
  for (int i = 0; i < 5; ++i) {
    offloaded.push_back(offload(at::randn({1024}), 0, "aten::test"));
  }
  const OffloadStats before = stats();
  for (int i = 4; i >= 0; --i) {
    offloaded[i].reload();
    offloaded.pop_back();
  }
  const OffloadStats after = stats();
  // The first reload is on demand; each brings back the next ones.
  EXPECT_EQ(after.late - before.late, 1);
  EXPECT_EQ(after.prefetched - before.prefetched, 4);
  EXPECT_LE(after.peak_prefetched_bytes, o.prefetch_bytes);
  EXPECT_EQ(after.prefetched_bytes, 0);
}

TEST_F(Offloader, LastOffloadedStayOnTheDevice) {
  OffloadOptions o = options();
  o.keep_last_bytes = 2 * 256 * 4;
  set_options(o);
  std::vector<at::Tensor> tensors;
  std::vector<OffloadedTensor> offloaded;
  const OffloadStats before = stats();
  for (int i = 0; i < 4; ++i) {
    offloaded.push_back(offload(at::randn({256}), 0, "aten::test"));
  }
  EXPECT_EQ(stats().offloaded_bytes - before.offloaded_bytes, 2 * 256 * 4);
  for (auto& off : offloaded) {
    off.reload();
  }
  EXPECT_EQ(stats().kept_last - before.kept_last, 2);
}

TEST_F(Offloader, CopiesAreTimedUnderTheirOp) {
  auto times_of = [](const std::string& op) {
    for (const auto& [name, times] : copy_times_by_op()) {
      if (name == op) {
        return times;
      }
    }
    return CopyTimes{};
  };
  const CopyTimes before = times_of("aten::timed_test");
  const CopyTimes total_before = stats().timed;
  {
    OffloadedTensor off = offload(at::randn({4096}), 0, "aten::timed_test");
    off.reload();
  }
  CopyTimes moved = times_of("aten::timed_test");
  moved += CopyTimes{-before.d2h_ns, -before.h2d_ns, -before.waited_ns, -before.waits};
  // The stand-in copies on the compute thread: all of it waited, one wait
  // per copy; stats() sums the same figures.
  EXPECT_GT(moved.d2h_ns, 0);
  EXPECT_GT(moved.h2d_ns, 0);
  EXPECT_EQ(moved.waited_ns, moved.d2h_ns + moved.h2d_ns);
  EXPECT_EQ(moved.waits, 2);
  EXPECT_EQ(stats().timed.waits - total_before.waits, 2);
}

TEST(OffloadOptionsCheck, BadValuesRaiseValueError) {
  OffloadOptions o = options();
  o.prefetch_bytes = -1;
  EXPECT_THROW(set_options(o), c10::ValueError);
  o = options();
  o.host_limit_bytes = 0;
  EXPECT_THROW(set_options(o), c10::ValueError);
}

TEST(OffloadEligibility, NamesWhy) {
  OffloadOptions o;
  EXPECT_NE(why_not_offloadable(at::randn({4}), o, false), nullptr); // CPU
  o.cpu_stand_in = true;
  EXPECT_EQ(why_not_offloadable(at::randn({1 << 20}), o, false), nullptr);
  EXPECT_NE(why_not_offloadable(at::randn({4}), o, false), nullptr); // below min_bytes
  EXPECT_EQ(why_not_offloadable(at::randn({4}), o, /*must=*/true), nullptr);
}

} // namespace
} // namespace torch_sac::offload
