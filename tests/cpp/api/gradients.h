#pragma once
// Shared by the C++ API tests: the gradients of one step, compared bitwise.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <functional>
#include <vector>

namespace torch_sac::testing {

// Runs forward (which may open regions) and backward of its output's squared
// sum on a fixed input (seed 1) and dropout seed (2); returns the gradients
// of the input and of `params`, whose .grad is reset.
inline std::vector<at::Tensor> step_gradients(
    at::IntArrayRef input_shape,
    const std::vector<at::Tensor>& params,
    const std::function<at::Tensor(const at::Tensor&)>& forward) {
  at::manual_seed(1);
  const auto x = at::randn(input_shape).requires_grad_();
  at::manual_seed(2);
  forward(x).pow(2).sum().backward();
  std::vector<at::Tensor> grads{x.grad().clone()};
  for (const at::Tensor& t : params) {
    grads.push_back(t.grad().clone());
    t.mutable_grad().reset();
  }
  return grads;
}

inline void expect_bitwise_equal(
    const std::vector<at::Tensor>& a,
    const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::equal(a[i], b[i])) << "gradient " << i << " differs";
  }
}

} // namespace torch_sac::testing
