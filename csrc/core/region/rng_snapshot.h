#pragma once
// The random-number state a seeded op drew from, so that replaying the op
// draws the same numbers (dropout masks, rand*, bernoulli_, normal_, ...).
//
// Device-specific on purpose and nowhere else: the generator is found through
// at::globalContext().defaultGenerator(device), which reaches the CUDA
// generator through ATen's hooks without torch_sac linking CUDA.

#include <ATen/core/Generator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/FunctionRef.h>

#include <optional>

namespace torch_sac::region {

class RngSnapshot {
 public:
  // The state before `op` runs with `args`, a call that draws random
  // numbers (call_draws_random in csrc/core/op_facts.h), or
  // nullopt when it runs on a device without a generator (meta).
  static std::optional<RngSnapshot> capture(
      const c10::OperatorHandle& op,
      c10::ArrayRef<c10::IValue> args);

  // Runs `run(args)` drawing from the captured state. An op with a Generator
  // argument gets a fresh copy of the captured generator in that argument
  // (nothing global changes); one without draws from the device's default
  // generator, which is set to the captured state for the call and restored
  // afterwards.
  void replay(torch::jit::Stack& args, c10::function_ref<void()> run) const;

 private:
  std::optional<size_t> generator_arg_; // index of the op's Generator? argument
  at::Generator state_;                 // a clone holding the state to replay
  at::Generator default_generator_;     // set when state_ is the default's
};

} // namespace torch_sac::region
