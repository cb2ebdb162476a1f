#include "csrc/core/region/collective_agreement.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/hash.h>
#include <c10/util/irange.h>

#include <functional>
#include <mutex>
#include <optional>
#include <sstream>
#include <unordered_set>

#include "csrc/core/region/c10d_objects.h"
#include "csrc/core/replay_guard.h"

namespace torch_sac::region {
namespace {

c10::OperatorHandle functional_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Element-wise max over the ranks of `group`, waited for.
at::Tensor all_reduce_max(const at::Tensor& t, const std::string& group) {
  static const c10::OperatorHandle all_reduce = functional_op("_c10d_functional::all_reduce");
  static const c10::OperatorHandle wait = functional_op("_c10d_functional::wait_tensor");
  torch::jit::Stack stack{t, c10::IValue(std::string("max")), c10::IValue(group)};
  all_reduce.callBoxed(stack);
  torch::jit::Stack waited{stack.back()};
  wait.callBoxed(waited);
  return waited.back().toTensor();
}

// Group and pattern pairs the ranks agreed on in this process: each is
// checked until they do (every rank of the group fails alike, so every rank
// checks again).
class Agreed {
 public:
  bool contains(size_t key) {
    std::lock_guard<std::mutex> lock(mutex_);
    return keys_.count(key) > 0;
  }
  void add(size_t key) {
    std::lock_guard<std::mutex> lock(mutex_);
    keys_.insert(key);
  }

 private:
  std::mutex mutex_;
  std::unordered_set<size_t> keys_;
};

Agreed& agreed_patterns() {
  static Agreed* const instance = new Agreed(); // leaked: used until exit
  return *instance;
}

} // namespace

void CollectiveAgreement::note(
    const c10::OperatorHandle& op,
    const OpFacts& facts,
    int64_t call_index,
    c10::ArrayRef<c10::IValue> inputs,
    bool recomputed) {
  const auto& args = op.schema().arguments();
  std::string group_name;
  std::optional<c10::Device> device;
  for (const auto i : c10::irange(std::min(args.size(), inputs.size()))) {
    if (args[i].name() == "group_name" && inputs[i].isString()) {
      group_name = inputs[i].toStringRef();
    } else if (args[i].name() == "process_group") { // c10d's
      group_name = c10d_group_name(inputs[i]);
    } else if (!device && inputs[i].isTensor() && inputs[i].toTensor().defined()) {
      device = inputs[i].toTensor().device();
    } else if (!device && inputs[i].isTensorList() && !inputs[i].toTensorList().empty()) {
      device = inputs[i].toTensorList().get(0).device();
    }
  }
  Group& group = groups_[group_name];
  if (device) {
    group.device = *device;
  }
  group.pattern = c10::hash_combine(group.pattern, std::hash<std::string>{}(facts.name));
  group.decisions = c10::hash_combine(group.decisions, recomputed ? 1 : 2);
  ++group.collectives;
  if (recomputed) {
    group.recomputed.push_back(c10::str(facts.name, " #", call_index));
  }
}

void CollectiveAgreement::note_dependent_pack(
    int64_t pack_index,
    const std::vector<EntryId>& collectives) {
  size_t h = c10::hash_combine(dependent_packs_hash_, static_cast<size_t>(pack_index));
  for (EntryId e : collectives) {
    h = c10::hash_combine(h, e.index());
  }
  dependent_packs_hash_ = h;
  ++dependent_packs_;
}

void CollectiveAgreement::check() const {
  for (const auto& [name, group] : groups_) {
    const size_t key = c10::hash_combine(std::hash<std::string>{}(name), group.pattern);
    if (name.empty() || agreed_patterns().contains(key)) {
      continue;
    }
    // Equal on every rank iff the max of h and of ~h is this rank's own.
    const auto h = static_cast<int64_t>(
        c10::hash_combine(group.decisions, dependent_packs_hash_) >> 1);
    at::Tensor mine = at::empty({2}, at::TensorOptions().dtype(at::kLong));
    mine.data_ptr<int64_t>()[0] = h;
    mine.data_ptr<int64_t>()[1] = ~h;
    at::Tensor agreed;
    {
      const ReplayGuard plain; // the region's own call: not recorded, no modes
      agreed = all_reduce_max(mine.to(group.device), name).cpu();
    }
    const int64_t* max = agreed.data_ptr<int64_t>();
    if (max[0] == h && max[1] == ~h) {
      agreed_patterns().add(key);
      continue;
    }
    std::ostringstream recomputed;
    for (const auto i : c10::irange(group.recomputed.size())) {
      recomputed << (i ? ", " : "") << group.recomputed[i];
    }
    TORCH_CHECK(
        false, "torch_sac: the ranks of process group '", name,
        "' checkpoint a sac_context region differently, so backward would replay its "
        "collectives on some ranks only, or at other points than on the others, and hang. "
        "This rank recomputes ",
        group.recomputed.size(), " of the region's ", group.collectives, " collectives on it",
        group.recomputed.empty() ? "" : " (", recomputed.str(), group.recomputed.empty() ? "" : ")",
        " and drops ", dependent_packs_,
        " saved tensors whose rebuild replays one; another rank differs. Give every rank the "
        "same policy (a plan made on one rank only, or a policy that depends on the rank, "
        "does not), or make the policy save the collectives' outputs (MUST_SAVE for "
        "the collectives named): then ranks may drop different tensors, since no replay runs "
        "a collective.");
  }
}

} // namespace torch_sac::region
