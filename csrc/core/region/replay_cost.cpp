#include "csrc/core/region/replay_cost.h"

#include "csrc/core/flop_count.h"
#include "csrc/core/ivalue_tensors.h"

namespace torch_sac::region {
namespace {

// Nominal rates of one CPU core; eager dispatch of one op.
constexpr double kOverheadNs = 1000;
constexpr double kFlopsPerNs = 20;
constexpr double kBytesPerNs = 5;

double tensor_bytes(c10::ArrayRef<c10::IValue> values) {
  double bytes = 0;
  for (const c10::IValue& v : values) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (t.defined()) {
        bytes += static_cast<double>(t.numel()) * static_cast<double>(t.element_size());
      }
    });
  }
  return bytes;
}

} // namespace

double estimated_replay_cost(
    const c10::OperatorHandle& op,
    c10::ArrayRef<c10::IValue> inputs,
    c10::ArrayRef<c10::IValue> outputs) {
  return kOverheadNs + count_flops(op, inputs, outputs) / kFlopsPerNs +
      (tensor_bytes(inputs) + tensor_bytes(outputs)) / kBytesPerNs;
}

} // namespace torch_sac::region
