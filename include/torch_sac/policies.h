#pragma once
// Checkpointing policies for torch_sac's C++ API: the built-ins (decided in
// C++, the same objects Python's torch_sac.policies wraps), policies written
// as C++ callables, and named scopes for save_by_name.
//
//   using namespace torch_sac::policies;
//   save_matmuls();                       // mm/addmm/bmm/baddbmm, convolutions, SDPA
//   recompute_all(); save_all();
//   save_ops({op("aten::mm"), op("aten::addmm.default")});
//   offload_matmuls(); offload_ops({op("aten::mm")});  // outputs to host memory (offload.h)
//   every_nth({op("aten::mm")}, 2);       // by call index within a region
//   save_by_name({"attn_out"});           // ops run inside torch_sac::NameScope("attn_out")
//   from_callable([](const torch_sac::OpCall& call) { ... return torch_sac::Policy::MustSave; });
//   save_calls({{{"aten::mm", ""}, 0}});  // exact (op, call index) pairs, as a budget plan saves

#include <string>
#include <string_view>

#include "csrc/core/name_scope.h"
#include "csrc/core/op_policy.h"
#include "csrc/core/policy.h"
#include "policies/budget_policy.h"
#include "policies/builtin_policies.h"
#include "torch_sac/sac_context.h"

namespace torch_sac::policies {

// "aten::mm" matches every overload of aten::mm (a packet, as torch.ops.aten.mm
// in Python); "aten::mm.default" only the default overload; "aten::add.Tensor"
// one named overload. Raises ValueError for a name without a namespace.
OpPattern op(std::string_view qualified_name);

// A policy that calls `fn` once per op in forward, after the op ran. `fn` may
// throw: the error propagates out of the op, naming nothing extra, and the
// region stays consistent. `description` is what describe() returns.
PolicyPtr from_callable(PolicyFn fn, std::string description = "C++ callable");

} // namespace torch_sac::policies
