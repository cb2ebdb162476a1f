#pragma once
// Runs ops the way the interceptor saw them: below autograd, autocast,
// Python modes and torch_sac's own key (all of which sit at or above the
// Python key), with grad off. For region replays, the region's own copies
// and the drop-in's redirected writes.

#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "csrc/core/interceptor.h"

namespace torch_sac {

class ReplayGuard {
 public:
  ReplayGuard()
      : below_python_(
            (c10::DispatchKeySet(c10::DispatchKeySet::FULL) -
             c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Python)) |
            // The key adapter's key sits below Python: without it here, a
            // replay run while a region is open on this thread (backward
            // inside the `with` block) would be recorded by that region, or
            // deadlock on the mutex of the region replaying.
            c10::DispatchKeySet(kInterceptKey)),
        no_grad_(false) {}

 private:
  c10::impl::ExcludeDispatchKeyGuard below_python_;
  c10::AutoGradMode no_grad_;
};

} // namespace torch_sac
