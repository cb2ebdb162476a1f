// The budget profiler's op handler. The same steps as _ProfileMode in
// torch_sac/_op_profile.py, below autograd through the key adapter instead
// of a TorchDispatchMode, so it sees exactly the ops a SacContext's region
// records and counts their calls the same way.

#include "csrc/api/op_profile.h"

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "csrc/api/autograd_hooks.h"
#include "csrc/core/flop_count.h"
#include "csrc/core/ignored_ops.h"
#include "csrc/core/interceptor.h"
#include "csrc/core/ivalue_tensors.h"
#include "csrc/core/tensor_version.h"
#include "torch_sac/sac_context.h"

namespace torch_sac::api {
namespace {

using Clock = std::chrono::steady_clock;

int64_t nanoseconds_since(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
}

// The storage behind `t` as the region identifies it; tensors without one
// (sparse, nested) count as a storage of their own.
const void* storage_key(const at::Tensor& t) {
  return t.has_storage() ? static_cast<const void*>(t.storage().unsafeGetStorageImpl())
                         : static_cast<const void*>(t.unsafeGetTensorImpl());
}

int64_t storage_nbytes(const at::Tensor& t) {
  return t.has_storage() ? static_cast<int64_t>(t.storage().nbytes())
                         : t.numel() * static_cast<int64_t>(t.element_size());
}

// Ops that can run again without side effects, for timing.
bool replayable(const c10::OperatorHandle& op) {
  const std::string& name = op.operator_name().name;
  const bool builtin = name.rfind("aten::", 0) == 0 || name.rfind("prims::", 0) == 0;
  return builtin && !op.schema().is_mutable() && !op.hasTag(at::Tag::nondeterministic_seeded);
}

// Timings must include the kernels, not just their launch.
void synchronize(c10::ArrayRef<c10::IValue> inputs) {
  for (const c10::IValue& v : inputs) {
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_cuda()) {
      const c10::Device device = v.toTensor().device();
      c10::impl::getDeviceGuardImpl(device.type())->synchronizeDevice(device.index());
      return;
    }
  }
}

double median(std::vector<int64_t> ns) {
  std::sort(ns.begin(), ns.end());
  const size_t n = ns.size();
  const double mid = n % 2 ? static_cast<double>(ns[n / 2])
                           : 0.5 * static_cast<double>(ns[n / 2 - 1] + ns[n / 2]);
  return mid * 1e-9;
}

// Restores the default CPU and CUDA generators on exit, as
// torch.random.fork_rng: profiling draws the dropout masks the real run
// will draw again.
class GeneratorStatesGuard {
 public:
  GeneratorStatesGuard() {
    save(at::detail::getDefaultCPUGenerator());
    if (at::hasCUDA()) {
      const c10::DeviceIndex devices = at::detail::getCUDAHooks().deviceCount();
      for (c10::DeviceIndex i = 0; i < devices; ++i) {
        save(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, i)));
      }
    }
  }
  ~GeneratorStatesGuard() {
    for (auto& [generator, state] : saved_) {
      try {
        std::lock_guard<std::mutex> lock(generator.mutex());
        generator.set_state(state);
      } catch (const std::exception& e) {
        TORCH_WARN("torch_sac::policies::budget: could not restore a random generator: ", e.what());
      }
    }
  }
  GeneratorStatesGuard(const GeneratorStatesGuard&) = delete;
  GeneratorStatesGuard& operator=(const GeneratorStatesGuard&) = delete;

 private:
  void save(at::Generator generator) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    at::Tensor state = generator.get_state();
    saved_.emplace_back(std::move(generator), std::move(state));
  }
  std::vector<std::pair<at::Generator, at::Tensor>> saved_;
};

class Profiler final : public OpHandler {
 public:
  explicit Profiler(int repeats) : repeats_(repeats) {}

  void handle(
      const c10::OperatorHandle& op,
      torch::jit::Stack* stack,
      RunOp run,
      const void* /*adapter_view*/) override {
    // What the region lets through unrecorded.
    if (c10::InferenceMode::is_enabled() || interception_paused()) {
      run(stack);
      return;
    }
    const size_t num_args = op.schema().arguments().size();
    const std::vector<c10::IValue> inputs(stack->end() - num_args, stack->end());
    // A storage an op reads before any op in the region produced it comes
    // from outside the region.
    for (const c10::IValue& v : inputs) {
      for_each_tensor(v, [&](const at::Tensor& t) {
        if (t.defined()) { // an absent Tensor? argument may be boxed as undefined
          storage_of(t, /*internal=*/false);
        }
      });
    }
    synchronize(inputs);
    auto start = Clock::now();
    run(stack);
    synchronize(inputs);
    std::vector<int64_t> elapsed{nanoseconds_since(start)};

    const size_t num_returns = op.schema().returns().size();
    const c10::ArrayRef<c10::IValue> outputs(
        stack->data() + stack->size() - num_returns, num_returns);
    const size_t known = storages_.size();
    std::vector<int64_t> storages;
    std::vector<at::Tensor> output_tensors;
    for (const c10::IValue& v : outputs) {
      for_each_tensor(v, [&](const at::Tensor& t) {
        if (!t.defined()) {
          return;
        }
        const int64_t s = storage_of(t, /*internal=*/true);
        if (std::find(storages.begin(), storages.end(), s) == storages.end()) {
          storages.push_back(s);
        }
        output_tensors.push_back(t);
      });
    }
    // Ignored ops get no call index in a region: not a policy item.
    if (is_ignored_op(op.operator_name())) {
      return;
    }
    if (repeats_ > 0 && replayable(op)) {
      for (int i = 0; i < repeats_; ++i) {
        torch::jit::Stack replay(inputs.begin(), inputs.end());
        synchronize(inputs);
        start = Clock::now();
        run(&replay);
        synchronize(inputs);
        elapsed.push_back(nanoseconds_since(start));
      }
    }
    ProfiledCall call(op);
    call.call_index = counts_[op]++;
    call.seconds = median(std::move(elapsed));
    call.flops = count_flops(op, inputs, outputs);
    for (int64_t s : storages) {
      if (static_cast<size_t>(s) >= known) {
        call.new_storages.push_back(s);
      }
    }
    call.storages = std::move(storages);
    calls_.push_back(std::move(call));

    // The version each output has once the op returns to autograd: a view's
    // counter becomes its base's (set above this dispatch level); an in-place
    // op's output is bumped there, so it always reads as mutated, as the
    // region sees it too.
    std::vector<std::pair<at::Tensor, uint32_t>> versions;
    for (const at::Tensor& t : output_tensors) {
      uint32_t version = version_of(t);
      for (const c10::IValue& v : inputs) {
        bool found = false;
        for_each_tensor(v, [&](const at::Tensor& in) {
          if (!found && in.defined() && storage_key(in) == storage_key(t)) {
            version = version_of(in);
            found = true;
          }
        });
        if (found) {
          break;
        }
      }
      versions.emplace_back(t, version);
    }
    output_versions_.push_back(std::move(versions));
  }

  void note_saved(const at::Tensor& t) {
    saved_.push_back(t);
  }

  // Once `fn` returned: which outputs were mutated later, which storages
  // autograd saved, and the totals.
  RegionProfile finish() {
    RegionProfile profile;
    for (const at::Tensor& t : saved_) {
      if (auto it = storage_index_.find(storage_key(t)); it != storage_index_.end()) {
        storages_[it->second].saved_by_autograd = true;
      }
    }
    for (size_t i = 0; i < calls_.size(); ++i) {
      for (const auto& [t, version] : output_versions_[i]) {
        if (version_of(t) != version) {
          calls_[i].saveable = false;
          calls_[i].why_not = calls_[i].op.schema().is_mutable() ? "in-place op"
                                                                 : "output mutated in place later";
          break;
        }
      }
    }
    std::vector<bool> held(storages_.size(), false);
    for (const ProfiledCall& call : calls_) {
      for (int64_t s : call.storages) {
        held[s] = true;
      }
    }
    for (size_t s = 0; s < storages_.size(); ++s) {
      if (!storages_[s].internal) {
        continue;
      }
      if (storages_[s].saved_by_autograd) {
        profile.activation_bytes += storages_[s].nbytes;
      }
      if (held[s]) {
        profile.total_bytes += storages_[s].nbytes;
      }
    }
    profile.calls = std::move(calls_);
    profile.storages = std::move(storages_);
    return profile;
  }

 private:
  int64_t storage_of(const at::Tensor& t, bool internal) {
    const void* key = storage_key(t);
    auto [it, inserted] = storage_index_.try_emplace(key, static_cast<int64_t>(storages_.size()));
    if (inserted) {
      storages_.push_back(ProfiledStorage{storage_nbytes(t), internal});
      // Keeps the storage alive, so its address is not reused while
      // profiling.
      keep_.push_back(t);
    }
    return it->second;
  }

  const int repeats_;
  std::vector<ProfiledCall> calls_;
  std::vector<ProfiledStorage> storages_;
  std::unordered_map<const void*, int64_t> storage_index_;
  std::unordered_map<c10::OperatorHandle, int64_t> counts_;
  std::vector<at::Tensor> keep_;
  std::vector<std::vector<std::pair<at::Tensor, uint32_t>>> output_versions_; // per call
  std::vector<at::Tensor> saved_;                                             // by autograd
};

} // namespace

int64_t RegionProfile::call_bytes(const ProfiledCall& call) const {
  int64_t bytes = 0;
  for (int64_t s : call.storages) {
    bytes += storages[s].internal ? storages[s].nbytes : 0;
  }
  return bytes;
}

int64_t RegionProfile::new_bytes(const ProfiledCall& call) const {
  int64_t bytes = 0;
  for (int64_t s : call.new_storages) {
    bytes += storages[s].nbytes;
  }
  return bytes;
}

RegionProfile profile_region(const std::function<void()>& fn, int repeats) {
  TORCH_CHECK_VALUE(
      !in_sac_context(),
      "torch_sac::policies::budget: called inside a SacContext. Profiling must see the region's "
      "ops as a forward without checkpointing does: make the plan before entering the region.");
  install_region_autograd_hooks();
  install_key_adapter();
  auto profiler = std::make_shared<Profiler>(repeats);
  {
    // Destroyed in reverse order, also when `fn` throws: interception first,
    // the generators' states last (restoring them runs no intercepted op).
    const GeneratorStatesGuard generators;
    const c10::AutoGradMode grad(true);
    const SavedTensorObserver observer([&](const at::Tensor& t) { profiler->note_saved(t); });
    const KeyAdapterScope intercept(profiler);
    fn();
  }
  return profiler->finish();
}

} // namespace torch_sac::api
