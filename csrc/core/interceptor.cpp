#include "csrc/core/interceptor.h"

#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "csrc/core/torch_compat.h"

namespace torch_sac {

bool recording_disabled() {
  return !c10::GradMode::is_enabled() || c10::InferenceMode::is_enabled();
}

namespace {
thread_local int opaque_code_depth = 0;
} // namespace

bool interception_paused() {
  if (opaque_code_depth > 0) {
    return true;
  }
  // FakeTensorMode runs its meta kernels with Meta in the TLS included set
  // (in_kernel_invocation_manager), while the mode itself is stashed away:
  // DTensor's sharding propagation, on the first call of each op and
  // layout, so a drop-in would number the calls of that first forward
  // differently from its recompute.
  if (c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Meta)) {
    return true;
  }
  using c10::impl::TorchDispatchModeKey;
  using c10::impl::TorchDispatchModeTLS;
  if (!TorchDispatchModeTLS::any_modes_set()) {
    return false;
  }
  return TorchDispatchModeTLS::get_mode(TorchDispatchModeKey::FAKE).has_value() ||
      TorchDispatchModeTLS::get_mode(TorchDispatchModeKey::PROXY).has_value() ||
      TorchDispatchModeTLS::get_mode(TorchDispatchModeKey::FUNCTIONAL).has_value();
}

OpaqueCodeGuard::OpaqueCodeGuard() {
  ++opaque_code_depth;
}

OpaqueCodeGuard::~OpaqueCodeGuard() {
  --opaque_code_depth;
}

InterceptNestedOps::InterceptNestedOps()
    : was_excluded_(c10::impl::tls_is_dispatch_key_excluded(kInterceptKey)) {
  if (was_excluded_) {
    c10::impl::tls_set_dispatch_key_excluded(kInterceptKey, false);
  }
}

InterceptNestedOps::~InterceptNestedOps() {
  if (was_excluded_) {
    c10::impl::tls_set_dispatch_key_excluded(kInterceptKey, true);
  }
}

namespace {

// Handlers of this thread, innermost last. shared_ptr keeps a handler alive
// while an op it is handling still runs, even if its scope already ended.
thread_local std::vector<std::shared_ptr<OpHandler>> tls_handlers;

void run_level(
    const c10::OperatorHandle& op,
    torch::jit::Stack* stack,
    size_t level,
    c10::DispatchKeySet below) {
  if (level == 0) {
    op.redispatchBoxed(below, stack);
    return;
  }
  // Copy: a handler may push or pop handlers while it runs.
  std::shared_ptr<OpHandler> handler = tls_handlers[level - 1];
  handler->handle(
      op, stack, [&](torch::jit::Stack* s) { run_level(op, s, level - 1, below); },
      /*adapter_view=*/nullptr);
}

void key_fallback(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack) {
  // Ops the handlers or kernels run from here on are not intercepted again.
  c10::impl::ExcludeDispatchKeyGuard no_reentry(kInterceptKey);
  const auto below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kInterceptKey);
  // The key may be in the TLS of a thread with no handler: autograd copies the
  // dispatch TLS of the thread that called backward into its workers.
  run_level(op, stack, tls_handlers.size(), below);
}

std::mutex install_mutex;
std::unique_ptr<torch::Library> fallback_library;

void set_intercepting(bool on) {
  c10::impl::tls_set_dispatch_key_included(kInterceptKey, on);
}

} // namespace

std::string key_adapter_unavailable_reason() {
  if (fallback_library) {
    return "";
  }
  auto& dispatcher = c10::Dispatcher::singleton();
  if (dispatcher.hasBackendFallbackForDispatchKey(kInterceptKey)) {
    return std::string("this torch registers its own fallback on DispatchKey::") +
        c10::toString(kInterceptKey);
  }
  for (const auto& name : dispatcher.getAllOpNames()) {
    auto op = dispatcher.findOp(name);
    if (op && op->hasKernelForDispatchKey(kInterceptKey)) {
      return "this torch registers a kernel for " + c10::toString(name) +
          " on DispatchKey::" + c10::toString(kInterceptKey);
    }
  }
  return "";
}

bool key_adapter_runs_below_modes() {
  static_assert(
      kInterceptKey == c10::DispatchKey::Fake,
      "torch_compat.h describes DispatchKey::Fake's position");
  return compat::kFakeKeyBelowPython;
}

void install_key_adapter() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (fallback_library) {
    return;
  }
  const std::string reason = key_adapter_unavailable_reason();
  TORCH_CHECK(
      reason.empty(), "torch_sac: the dispatch-key adapter is unavailable: ", reason,
      ". Use the Python-key adapter (TORCH_SAC_ADAPTER=python).");
  fallback_library = std::make_unique<torch::Library>(
      torch::Library::IMPL, "_", kInterceptKey, __FILE__, __LINE__);
  fallback_library->fallback(torch::CppFunction::makeFromBoxedFunction<&key_fallback>());
}

bool key_adapter_installed() {
  std::lock_guard<std::mutex> lock(install_mutex);
  return fallback_library != nullptr;
}

void push_key_handler(std::shared_ptr<OpHandler> handler) {
  TORCH_CHECK(handler, "torch_sac: cannot push a null op handler");
  TORCH_CHECK(
      key_adapter_installed(),
      "torch_sac: the dispatch-key adapter is not installed; call "
      "install_key_adapter() first");
  tls_handlers.push_back(std::move(handler));
  set_intercepting(true);
}

void pop_key_handler(const OpHandler* expected_top) {
  auto it = std::find_if(tls_handlers.rbegin(), tls_handlers.rend(), [&](const auto& h) {
    return h.get() == expected_top;
  });
  TORCH_CHECK(
      it != tls_handlers.rend(),
      "torch_sac: a checkpoint context exited on a thread that did not enter it; "
      "contexts must exit on the thread that entered them");
  const bool was_top = it == tls_handlers.rbegin();
  // Removed even when out of order: nothing stays installed after an error.
  tls_handlers.erase(std::next(it).base());
  if (tls_handlers.empty()) {
    set_intercepting(false);
  }
  TORCH_CHECK(
      was_top,
      "torch_sac: checkpoint contexts must exit in the reverse order they were "
      "entered; this one was exited while another entered after it was active");
}

size_t key_handler_depth() {
  return tls_handlers.size();
}

KeyAdapterScope::KeyAdapterScope(std::shared_ptr<OpHandler> handler) : handler_(handler.get()) {
  push_key_handler(std::move(handler));
}

KeyAdapterScope::~KeyAdapterScope() {
  pop_key_handler(handler_);
}

} // namespace torch_sac
