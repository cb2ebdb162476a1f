#pragma once

// Differences between the torch releases torch_sac supports (2.11 to 2.15),
// in one place. Each fact names the releases on each side and is read from
// the headers being compiled against, never from a version number, so a
// build is right for exactly the torch it was built with. The Python
// counterpart is torch_sac/_compat.py.

#include <c10/core/DispatchKey.h>

#include <cstdint>

namespace torch_sac::compat {

// Where the key adapter's key (DispatchKey::Fake) sits relative to Python,
// the key TorchDispatchModes run at. A higher functionality key runs first.
//   torch <= 2.12: Fake is above Python, so a fallback on it sees each op
//                  before any TorchDispatchMode does;
//   torch >= 2.13: Fake is below Python, so it sees an op after the modes,
//                  exactly where the Python-key adapter's mode would.
inline constexpr bool kFakeKeyBelowPython = static_cast<uint16_t>(c10::DispatchKey::Fake) <
    static_cast<uint16_t>(c10::DispatchKey::Python);

} // namespace torch_sac::compat
