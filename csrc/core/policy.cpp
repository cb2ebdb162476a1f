#include "csrc/core/policy.h"

#include <c10/util/Exception.h>

namespace torch_sac {

std::string_view policy_name(Policy p) {
  switch (p) {
    case Policy::MustSave:
      return "MUST_SAVE";
    case Policy::PreferSave:
      return "PREFER_SAVE";
    case Policy::MustRecompute:
      return "MUST_RECOMPUTE";
    case Policy::PreferRecompute:
      return "PREFER_RECOMPUTE";
    case Policy::MustOffload:
      return "MUST_OFFLOAD";
    case Policy::PreferOffload:
      return "PREFER_OFFLOAD";
  }
  return "<invalid Policy>";
}

Policy combine_policies(Policy outer, Policy inner, std::string_view op_name) {
  if (is_must(outer) && is_must(inner)) {
    TORCH_CHECK(
        outer == inner, "torch_sac: nested checkpoint policies disagree on ", op_name,
        ": the outer region says ", policy_name(outer), " and the inner region says ",
        policy_name(inner), ". Two MUST_* decisions cannot both hold; make one of them PREFER_*.");
    return inner;
  }
  if (is_must(outer)) {
    return outer;
  }
  return inner;
}

} // namespace torch_sac
