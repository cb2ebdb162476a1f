#include "ignored_ops.h"

#include <algorithm>

namespace torch_sac {

const std::vector<c10::OperatorName>& ignored_op_names() {
  // torch.utils.checkpoint.SAC_IGNORED_OPS in torch 2.13: detach, prim::device
  // and FunctionalTensor.metadata_fns.
  static const std::vector<c10::OperatorName> names = {
      {"aten::detach", ""},
      {"prim::device", ""},
      {"aten::dim", ""},
      {"aten::is_contiguous", ""},
      {"aten::is_contiguous", "memory_format"},
      {"aten::is_non_overlapping_and_dense", ""},
      {"aten::is_strides_like_format", ""},
      {"aten::numel", ""},
      {"aten::size", ""},
      {"aten::stride", ""},
      {"aten::storage_offset", ""},
      {"aten::sym_numel", ""},
      {"aten::sym_size", ""},
      {"aten::sym_storage_offset", ""},
      {"aten::sym_stride", ""},
  };
  return names;
}

bool is_ignored_op(const c10::OperatorName& name) {
  const auto& names = ignored_op_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

} // namespace torch_sac
