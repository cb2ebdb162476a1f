// Policies of the C++ API that are not in the built-in library: op patterns
// parsed from qualified names and policies written as C++ callables.

#include <c10/util/Exception.h>

#include <utility>

#include "torch_sac/policies.h"

namespace torch_sac::policies {
namespace {

class CallablePolicy final : public OpPolicy {
 public:
  CallablePolicy(PolicyFn fn, std::string description)
      : fn_(std::move(fn)), description_(std::move(description)) {}

  Policy decide(const OpCall& call) override {
    return fn_(call);
  }
  std::string describe() const override {
    return description_;
  }
  // A callable may look at anything, the call index included.
  bool needs_call_index() const override {
    return true;
  }

 private:
  PolicyFn fn_;
  std::string description_;
};

} // namespace

OpPattern op(std::string_view qualified_name) {
  const size_t ns = qualified_name.find("::");
  TORCH_CHECK_VALUE(
      ns != std::string_view::npos && ns > 0 && ns + 2 < qualified_name.size(),
      "torch_sac::policies::op: expected a qualified op name such as \"aten::mm\" or "
      "\"aten::add.Tensor\", got \"",
      qualified_name, "\"");
  const size_t dot = qualified_name.find('.', ns + 2);
  if (dot == std::string_view::npos) {
    return OpPattern{std::string(qualified_name), std::nullopt};
  }
  std::string_view overload = qualified_name.substr(dot + 1);
  TORCH_CHECK_VALUE(
      !overload.empty() && dot > ns + 2, "torch_sac::policies::op: malformed op name \"",
      qualified_name, "\"");
  // Python's OpOverload calls the unnamed overload "default".
  return OpPattern{
      std::string(qualified_name.substr(0, dot)),
      overload == "default" ? std::string() : std::string(overload)};
}

PolicyPtr from_callable(PolicyFn fn, std::string description) {
  TORCH_CHECK_VALUE(fn, "torch_sac::policies::from_callable: the callable is empty");
  return std::make_shared<CallablePolicy>(std::move(fn), std::move(description));
}

} // namespace torch_sac::policies
