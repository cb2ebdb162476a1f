#pragma once
// Which arguments an op writes to.

#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

namespace torch_sac {

// Indices of the arguments `op` may modify in place: those its schema marks
// `(a!)`, plus the running statistics of the batch-norm kernels whose
// schemas do not say they update them (native_batch_norm, cudnn_batch_norm,
// miopen_batch_norm in training mode).
std::vector<size_t> written_args(const c10::OperatorHandle& op);

} // namespace torch_sac
