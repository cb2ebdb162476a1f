#include "builtin_policies.h"

#include <c10/util/Exception.h>

#include <sstream>

#include "csrc/core/op_name.h"

namespace torch_sac::policies {
namespace {

class ConstantPolicy final : public OpPolicy {
 public:
  explicit ConstantPolicy(Policy decision) : decision_(decision) {}
  Policy decide(const OpCall&) override {
    return decision_;
  }
  bool needs_values() const override {
    return false;
  }
  std::string describe() const override {
    return decision_ == Policy::PreferSave ? "save_all()" : "recompute_all()";
  }

 private:
  Policy decision_;
};

class SaveOpsPolicy final : public OpPolicy {
 public:
  SaveOpsPolicy(const std::vector<OpPattern>& ops, std::string label)
      : matcher_(ops), label_(std::move(label)) {}
  Policy decide(const OpCall& call) override {
    return matcher_.matches(call.op.operator_name()) ? Policy::MustSave
                                                     : Policy::PreferRecompute;
  }
  bool needs_values() const override {
    return false;
  }
  std::string describe() const override {
    return label_.empty() ? "save_ops(" + matcher_.describe() + ")" : label_;
  }

 private:
  OpMatcher matcher_;
  std::string label_;
};

class EveryNthPolicy final : public OpPolicy {
 public:
  EveryNthPolicy(const std::vector<OpPattern>& ops, int64_t n)
      : matcher_(ops), n_(n) {}
  Policy decide(const OpCall& call) override {
    const bool save =
        matcher_.matches(call.op.operator_name()) && call.call_index % n_ == 0;
    return save ? Policy::MustSave : Policy::PreferRecompute;
  }
  bool needs_values() const override {
    return false;
  }
  std::string describe() const override {
    return "every_nth(" + matcher_.describe() + ", n=" + std::to_string(n_) + ")";
  }

 private:
  OpMatcher matcher_;
  int64_t n_;
};


} // namespace

OpMatcher::OpMatcher(const std::vector<OpPattern>& patterns) {
  for (const auto& p : patterns) {
    TORCH_CHECK_VALUE(
        p.name.find("::") != std::string::npos,
        "torch_sac: op name '", p.name,
        "' must be qualified with its namespace, e.g. 'aten::mm'");
    if (p.overload) {
      overloads_.insert(c10::OperatorName(p.name, *p.overload));
    } else {
      packets_.insert(p.name);
    }
  }
}

bool OpMatcher::matches(const c10::OperatorName& op) const {
  return (!overloads_.empty() && overloads_.count(op)) ||
      (!packets_.empty() && packets_.count(op.name));
}

std::string OpMatcher::describe() const {
  std::ostringstream out;
  out << "[";
  const char* sep = "";
  for (const auto& name : packets_) {
    out << sep << name;
    sep = ", ";
  }
  for (const auto& op : overloads_) {
    out << sep << op_display_name(op);
    sep = ", ";
  }
  out << "]";
  return out.str();
}

std::shared_ptr<OpPolicy> save_ops(const std::vector<OpPattern>& ops) {
  return std::make_shared<SaveOpsPolicy>(ops, "");
}

std::shared_ptr<OpPolicy> save_all() {
  return std::make_shared<ConstantPolicy>(Policy::PreferSave);
}

std::shared_ptr<OpPolicy> recompute_all() {
  return std::make_shared<ConstantPolicy>(Policy::PreferRecompute);
}

const std::vector<OpPattern>& matmul_ops() {
  static const std::vector<OpPattern> ops = {
      {"aten::mm", std::nullopt},
      {"aten::addmm", std::nullopt},
      {"aten::bmm", std::nullopt},
      {"aten::baddbmm", std::nullopt},
      {"aten::convolution", std::nullopt},
      {"aten::_convolution", std::nullopt},
      {"aten::mkldnn_convolution", std::nullopt},
      {"aten::cudnn_convolution", std::nullopt},
      {"aten::miopen_convolution", std::nullopt},
      {"aten::_scaled_dot_product_flash_attention", std::nullopt},
      {"aten::_scaled_dot_product_flash_attention_for_cpu", std::nullopt},
      {"aten::_scaled_dot_product_efficient_attention", std::nullopt},
      {"aten::_scaled_dot_product_cudnn_attention", std::nullopt},
      {"aten::_scaled_dot_product_fused_attention_overrideable", std::nullopt},
      {"aten::_flash_attention_forward", std::nullopt},
      {"aten::_efficient_attention_forward", std::nullopt},
  };
  return ops;
}

std::shared_ptr<OpPolicy> save_matmuls() {
  return std::make_shared<SaveOpsPolicy>(matmul_ops(), "save_matmuls()");
}

std::shared_ptr<OpPolicy> every_nth(const std::vector<OpPattern>& ops, int64_t n) {
  TORCH_CHECK_VALUE(n >= 1, "torch_sac: every_nth needs n >= 1, got ", n);
  return std::make_shared<EveryNthPolicy>(ops, n);
}

} // namespace torch_sac::policies
