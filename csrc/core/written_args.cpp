#include "csrc/core/written_args.h"

#include <algorithm>
#include <array>
#include <string_view>

namespace torch_sac {

std::vector<size_t> written_args(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  std::vector<size_t> written;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto& alias = schema.arguments()[i].alias_info();
    if (alias && alias->isWrite()) {
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
