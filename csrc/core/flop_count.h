#pragma once
// FLOPs of an op call, for the budget planner's Cost::Flops: the formulas of
// torch.utils.flop_counter for the ops it counts on any device (matrix
// multiplies and convolutions; its attention entries are CUDA kernels).

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

namespace torch_sac {

// 0 for ops not counted and for arguments the formulas do not fit.
double count_flops(
    const c10::OperatorHandle& op,
    c10::ArrayRef<c10::IValue> inputs,
    c10::ArrayRef<c10::IValue> outputs);

} // namespace torch_sac
