#pragma once
// What replaying an op call costs, as the replay budget weighs it when it
// spaces checkpoints (replay_budget.h).
//
// An estimate, not a measurement: measured times vary from run to run, and
// a plan recorded in one run (a replay schedule, a peak plan) must make the
// same choices, and so reach the same peak, in the next. A roofline-style
// sum of a fixed per-op overhead, the op's FLOPs (torch.utils.flop_counter's
// formulas: matrix multiplies and convolutions) and the bytes of its tensor
// inputs and outputs, with nominal CPU rates; only the ratios between ops
// matter.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>

namespace torch_sac::region {

// Nominal nanoseconds.
double estimated_replay_cost(
    const c10::OperatorHandle& op,
    c10::ArrayRef<c10::IValue> inputs,
    c10::ArrayRef<c10::IValue> outputs);

} // namespace torch_sac::region
