// The C++ API's link to autograd: tensors saved inside a SacContext go
// through the region's pack and unpack, with no Python in the process.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/engine.h>

#include "csrc/api/autograd_hooks.h"
#include "torch_sac/torch_sac.h"

namespace torch_sac {
namespace {

TEST(AutogradHooks, InstalledAtLoadAsTheDefaultEngine) {
  EXPECT_TRUE(api::region_autograd_hooks_installed());
  EXPECT_NE(
      &torch::autograd::Engine::get_default_engine(), &torch::autograd::Engine::get_base_engine());
}

TEST(AutogradHooks, SavedTensorsAreDroppedAndReplayed) {
  const auto x = at::randn({16}).requires_grad_();
  (x.sin().exp() * 2).sum().backward();
  const at::Tensor expected = x.grad().clone();
  x.mutable_grad().reset();

  RegionHandle handle;
  at::Tensor loss;
  {
    SacContext region(policies::recompute_all());
    loss = (x.sin().exp() * 2).sum();
    handle = region.handle();
  }
  EXPECT_GT(handle.stats().packed_dropped, 0);
  loss.backward();
  EXPECT_TRUE(at::equal(x.grad(), expected));
  EXPECT_GT(handle.stats().replayed_ops, 0);
}

TEST(AutogradHooks, NoHooksOutsideARegion) {
  EXPECT_EQ(
      torch::autograd::Engine::get_default_engine().get_default_saved_variable_hooks(), nullptr);
}

// Another engine as the default (PythonEngine in a Python process): a region
// could not reach autograd, so entering one raises, and nothing is installed.
struct ForeignEngine : torch::autograd::Engine {
  static Engine& get() {
    static ForeignEngine* engine = new ForeignEngine();
    return *engine;
  }
};

torch::autograd::Engine* engine_before_test = nullptr;

TEST(AutogradHooks, RefusesWhenAnotherEngineIsTheDefault) {
  engine_before_test = &torch::autograd::Engine::get_default_engine();
  torch::autograd::set_default_engine_stub(&ForeignEngine::get);
  try {
    SacContext region(policies::recompute_all());
    ADD_FAILURE() << "entered a region with a foreign default engine";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("PythonEngine"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(in_sac_context());
  EXPECT_FALSE(api::region_autograd_hooks_installed());
  torch::autograd::set_default_engine_stub(
      []() -> torch::autograd::Engine& { return *engine_before_test; });
  EXPECT_TRUE(api::region_autograd_hooks_installed());
}

} // namespace
} // namespace torch_sac
