#include "csrc/core/ignored_ops.h"

#include <algorithm>
#include <mutex>

#include "csrc/core/op_facts.h"

namespace torch_sac {
namespace {

std::vector<c10::OperatorName> base_names() {
  // torch.utils.checkpoint.SAC_IGNORED_OPS as of torch 2.13: detach,
  // prim::device and FunctionalTensor.metadata_fns. torch_sac's Python layer
  // adds the installed torch's own set at import (add_ignored_ops), so a
  // release that extends it (2.15: prim::layout) is followed without a copy.
  return {
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
}

std::mutex names_mutex;

std::vector<c10::OperatorName>& mutable_names() {
  static std::vector<c10::OperatorName> names = base_names();
  return names;
}

} // namespace

std::vector<c10::OperatorName> ignored_op_names() {
  std::lock_guard<std::mutex> lock(names_mutex);
  return mutable_names();
}

void add_ignored_ops(const std::vector<c10::OperatorName>& extra) {
  {
    std::lock_guard<std::mutex> lock(names_mutex);
    auto& names = mutable_names();
    for (const auto& name : extra) {
      if (std::find(names.begin(), names.end(), name) == names.end()) {
        names.push_back(name);
      }
    }
  }
  // Facts cached before hold the old answer. Outside the set's lock: computing
  // facts takes the cache's lock, then this set's (is_ignored_op).
  forget_op_facts();
}

bool is_ignored_op(const c10::OperatorName& name) {
  std::lock_guard<std::mutex> lock(names_mutex);
  const auto& names = mutable_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

} // namespace torch_sac
