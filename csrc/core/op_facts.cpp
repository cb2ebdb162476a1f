#include "csrc/core/op_facts.h"

#include <ATen/core/Tensor.h>
#include <c10/util/flat_hash_map.h>

#include <mutex>

#include "csrc/core/ignored_ops.h"
#include "csrc/core/op_name.h"
#include "csrc/core/written_args.h"

namespace torch_sac {
namespace {

bool is_collective(const c10::OperatorHandle& op) {
  const std::string& name = op.operator_name().name;
  for (const char* ns :
       {"c10d::", "_c10d_functional::", "_c10d_functional_autograd::", "_dtensor::"}) {
    if (name.rfind(ns, 0) == 0) {
      return true;
    }
  }
  return false;
}

// Facts of every op overload met so far, shared by all regions, contexts and
// threads: each meets its ops anew, and reading a schema is far dearer than
// a lookup.
class OpFactsCache final : public c10::OpRegistrationListener {
 public:
  std::shared_ptr<const OpFacts> get(const c10::OperatorHandle& op) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = facts_.find(op);
    if (it == facts_.end()) {
      it = facts_.emplace(op, std::make_shared<const OpFacts>(compute_op_facts(op))).first;
    }
    return it->second;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    facts_.clear();
  }
  void onOperatorRegistered(const c10::OperatorHandle& /*op*/) override {}
  void onOperatorDeregistered(const c10::OperatorHandle& op) override {
    std::lock_guard<std::mutex> lock(mutex_);
    facts_.erase(op);
  }

 private:
  std::mutex mutex_;
  ska::flat_hash_map<c10::OperatorHandle, std::shared_ptr<const OpFacts>> facts_;
};

OpFactsCache& cache() {
  // The dispatcher owns the listener. The registration handle is leaked on
  // purpose: undoing it at exit could run after the dispatcher is gone.
  static OpFactsCache* const instance = [] {
    auto listener = std::make_unique<OpFactsCache>();
    OpFactsCache* raw = listener.get();
    new c10::RegistrationHandleRAII(
        c10::Dispatcher::singleton().addRegistrationListener(std::move(listener)));
    return raw;
  }();
  return *instance;
}

} // namespace

OpFacts compute_op_facts(const c10::OperatorHandle& op) {
  OpFacts facts;
  facts.name = op_display_name(op);
  facts.ignored = is_ignored_op(op.operator_name());
  facts.written_args = written_args(op);
  facts.draws_random = op.hasTag(at::Tag::nondeterministic_seeded);
  facts.collective = is_collective(op);
  facts.collective_wait = op.operator_name().name == "_c10d_functional::wait_tensor" ||
      op.operator_name().name == "c10d_functional::wait_tensor";
  facts.filled_buffer = c10d_filled_buffer(op);
  facts.replayable_collective = (op.operator_name().name.rfind("_c10d_functional::", 0) == 0 &&
                                 !facts.collective_wait && facts.written_args.empty()) ||
      facts.filled_buffer.has_value();
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  facts.num_args = args.size();
  facts.num_returns = schema.returns().size();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].name() == "dropout_p") {
      facts.dropout_p_arg = i;
    }
  }
  for (const c10::Argument& ret : schema.returns()) {
    // A buffer-filling c10d collective returns its buffer, unannotated.
    const bool alias = ret.alias_info() != nullptr ||
        (facts.filled_buffer && ret.type()->kind() == c10::TypeKind::TensorType);
    const bool tensor = ret.type()->kind() == c10::TypeKind::TensorType ||
        ret.type()->isSubtypeOf(*c10::ListType::ofTensors());
    facts.returns_alias = facts.returns_alias || alias;
    facts.returns_written_arg = facts.returns_written_arg ||
        (alias && (!ret.alias_info() || ret.alias_info()->isWrite()));
    facts.makes_new_tensors = facts.makes_new_tensors || (tensor && !alias);
  }
  return facts;
}

std::shared_ptr<const OpFacts> op_facts(const c10::OperatorHandle& op) {
  return cache().get(op);
}

void forget_op_facts() {
  cache().clear();
}

} // namespace torch_sac
