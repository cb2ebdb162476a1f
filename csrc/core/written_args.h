#pragma once
// Which arguments an op writes to.

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <vector>

namespace torch_sac {

// Indices of the arguments `op` may modify in place: those its schema marks
// `(a!)`, plus the running statistics of the batch-norm kernels whose
// schemas do not say they update them (native_batch_norm, cudnn_batch_norm,
// miopen_batch_norm in training mode). c10d's collectives do not annotate
// their writes: those that fill a buffer (c10d_filled_buffer) write it, and
// every other one counts as writing every tensor it is passed.
std::vector<size_t> written_args(const c10::OperatorHandle& op);

// For a c10d collective that overwrites all of one tensor argument from the
// others and writes nothing else (the buffer `dist.all_gather_into_tensor`,
// `reduce_scatter_tensor` and `all_to_all_single` are given), that
// argument's index.
std::optional<size_t> c10d_filled_buffer(const c10::OperatorHandle& op);

} // namespace torch_sac
