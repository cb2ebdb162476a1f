#pragma once
// The op interceptor: one boxed handler stack, reached through one of two
// adapters.
//
//  * key adapter: a boxed fallback on a functionality key just below autograd
//    (DispatchKey::Fake, unused by torch 2.13), switched on per thread through
//    the TLS included set while a handler is active.
//  * Python-key adapter: a TorchDispatchMode whose __torch_dispatch__ is a C
//    function calling OpHandler::handle (see csrc/python/python_key_adapter).
//
// Both see exactly the ops a TorchDispatchMode sees.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/FunctionRef.h>

#include <memory>

namespace torch_sac {

// Runs the intercepted op for real: the next handler below, or the kernel.
using RunOp = c10::function_ref<void(torch::jit::Stack*)>;

class OpHandler {
 public:
  virtual ~OpHandler() = default;
  // `stack` holds the op's arguments; on return it must hold its outputs.
  // Called below autograd with the interceptor switched off for nested ops.
  // `adapter_view` is passed on to policies as OpCall::adapter_view.
  virtual void handle(
      const c10::OperatorHandle& op,
      torch::jit::Stack* stack,
      RunOp run,
      const void* adapter_view) = 0;
  // Whether ops on tensor subclasses (tensors with the Python key) go to the
  // subclass's __torch_dispatch__ untouched, so that this handler sees the
  // ops it runs on the inner tensors instead (a region: it records and
  // replays plain tensors). The Python-key adapter's mode then returns
  // NotImplemented for them; under the key adapter the handler itself
  // passes them through (InterceptNestedOps).
  virtual bool defers_to_subclasses() const {
    return false;
  }
};

// True when handlers should step aside and just run the op: with grad
// disabled or in inference mode no autograd graph is built, so nothing is
// saved for backward and there is nothing to record.
bool recording_disabled();

// True while handlers must let ops through untouched even inside an active
// region: while PyTorch traces (Dynamo's FakeTensors, AOTAutograd's proxies,
// functionalization: the ops are not the program that runs), and while
// opaque compiled code runs (an OpaqueCodeGuard is alive on this thread):
// such code writes tensors without dispatcher ops, so a replay could not
// reproduce it; and while FakeTensorMode runs its meta kernels (Meta in the
// TLS included set: DTensor's sharding propagation on a first call).
bool interception_paused();

// Marks compiled code running on this thread (see interception_paused()).
class OpaqueCodeGuard {
 public:
  OpaqueCodeGuard();
  ~OpaqueCodeGuard();
  OpaqueCodeGuard(const OpaqueCodeGuard&) = delete;
  OpaqueCodeGuard& operator=(const OpaqueCodeGuard&) = delete;
};

// While alive, ops dispatched on this thread reach the handlers again even
// from inside a handler (the key adapter excludes its key while a handler
// runs). For ops a handler passes through to a tensor subclass's
// __torch_dispatch__: the ops it runs on the subclass's inner (plain)
// tensors are the ones a region records. No effect under the Python-key
// adapter, whose mode defers such ops to the subclass itself.
class InterceptNestedOps {
 public:
  InterceptNestedOps();
  ~InterceptNestedOps();
  InterceptNestedOps(const InterceptNestedOps&) = delete;
  InterceptNestedOps& operator=(const InterceptNestedOps&) = delete;

 private:
  bool was_excluded_;
};

// The functionality key the key adapter claims.
constexpr c10::DispatchKey kInterceptKey = c10::DispatchKey::Fake;

// Why the key adapter cannot be used with the loaded torch, or "" if it can.
std::string key_adapter_unavailable_reason();

// Whether the key adapter intercepts ops after TorchDispatchModes have seen
// them, as the Python-key adapter does (torch >= 2.13; see torch_compat.h).
// Where it does not, the key adapter still works but runs before the modes,
// so "auto" picks the Python-key adapter there.
bool key_adapter_runs_below_modes();

// Registers the boxed fallback on kInterceptKey (idempotent). Raises when
// key_adapter_unavailable_reason() is not empty.
void install_key_adapter();
bool key_adapter_installed();

// Pushes `handler` on this thread's handler stack for the key adapter and
// switches interception on; pops it (LIFO) when destroyed.
class KeyAdapterScope {
 public:
  explicit KeyAdapterScope(std::shared_ptr<OpHandler> handler);
  ~KeyAdapterScope();
  KeyAdapterScope(const KeyAdapterScope&) = delete;
  KeyAdapterScope& operator=(const KeyAdapterScope&) = delete;

 private:
  OpHandler* handler_;
};

// Non-RAII form for context managers whose enter and exit are separate calls.
void push_key_handler(std::shared_ptr<OpHandler> handler);
void pop_key_handler(const OpHandler* expected_top);
size_t key_handler_depth();

} // namespace torch_sac
