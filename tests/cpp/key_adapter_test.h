#pragma once
// The fixture of the C++ tests that run ops through the interceptor: skips
// the test where the key adapter is unavailable on this torch, else installs
// it (docs/adapters.md).

#include <gtest/gtest.h>

#include <string>

#include "csrc/core/interceptor.h"

namespace torch_sac {

class KeyAdapterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = key_adapter_unavailable_reason();
    if (!reason.empty()) {
      GTEST_SKIP() << "key adapter unavailable on this torch: " << reason;
    }
    install_key_adapter();
    ASSERT_TRUE(key_adapter_installed());
  }
};

} // namespace torch_sac
