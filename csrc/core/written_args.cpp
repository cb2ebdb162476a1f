#include "csrc/core/written_args.h"

#include <algorithm>
#include <array>
#include <string_view>

namespace torch_sac {
namespace {

// Whether an argument of this type may hold a tensor (Tensor, Tensor?,
// Tensor[], Tensor[][]).
bool holds_tensors(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::TensorType) {
    return true;
  }
  if (const auto optional = type->cast<c10::OptionalType>()) {
    return holds_tensors(optional->getElementType());
  }
  if (const auto list = type->cast<c10::ListType>()) {
    return holds_tensors(list->getElementType());
  }
  return false;
}

} // namespace

std::optional<size_t> c10d_filled_buffer(const c10::OperatorHandle& op) {
  // Checked against the schemas of torch 2.11 to 2.15: the buffer is the
  // first argument, `Tensor output_tensor` (`output` for all-to-all).
  static constexpr std::array<std::string_view, 3> kFillBuffer = {
      "c10d::_allgather_base_", "c10d::_reduce_scatter_base_", "c10d::alltoall_base_"};
  const std::string& name = op.operator_name().name;
  if (std::find(kFillBuffer.begin(), kFillBuffer.end(), name) == kFillBuffer.end()) {
    return std::nullopt;
  }
  const auto& args = op.schema().arguments();
  if (args.size() < 2 || args[0].type()->kind() != c10::TypeKind::TensorType ||
      args[0].name().rfind("output", 0) != 0) {
    return std::nullopt; // a schema this rule was not checked against
  }
  return 0;
}

std::vector<size_t> written_args(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  std::vector<size_t> written;
  // c10d's collectives write their tensors in place (all_reduce, broadcast,
  // the outputs of all_gather and reduce_scatter, recv) but their schemas
  // say so nowhere: every tensor argument counts as written, but for the
  // buffer filling ones, whose one write is known. Otherwise a region
  // rebuilt `y` after `dist.all_reduce(y)` without the reduction
  // (Megatron-style tensor parallel does this in forward): wrong gradients
  // on more than one rank.
  if (const std::optional<size_t> buffer = c10d_filled_buffer(op)) {
    return {*buffer};
  }
  const bool c10d = op.operator_name().name.rfind("c10d::", 0) == 0;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto& arg = schema.arguments()[i];
    const auto& alias = arg.alias_info();
    if ((alias && alias->isWrite()) || (c10d && holds_tensors(arg.type()))) {
      written.push_back(i);
    }
  }
  // Checked against torch 2.13's schemas: running_mean and running_var are
  // arguments 3 and 4, typed `Tensor?` without a write annotation.
  static constexpr std::array<std::string_view, 3> kBatchNormKernels = {
      "aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm"};
  const std::string& name = schema.name();
  if (std::find(kBatchNormKernels.begin(), kBatchNormKernels.end(), name) !=
          kBatchNormKernels.end() &&
      schema.arguments().size() > 4 && schema.arguments()[3].name() == "running_mean" &&
      schema.arguments()[4].name() == "running_var") {
    written.push_back(3);
    written.push_back(4);
  }
  return written;
}

} // namespace torch_sac
