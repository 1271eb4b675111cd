#pragma once
// Blocks for the tests of a stage that fails: a linear block that throws on its n-th forward call,
// and a linear head.
#include <atomic>

#include "models/check.h"
#include "models/model.h"

namespace strata::test {

class FailingBlock : public models::Block {
 public:
  explicit FailingBlock(int64_t width) : lin_(register_module("lin", torch::nn::Linear(width, width))) {}
  torch::Tensor forward(const torch::Tensor& x) override {
    if (fail_after >= 0 && calls++ >= fail_after) throw Error("failure injected in a stage");
    return lin_->forward(x);
  }
  std::atomic<int> calls{0};
  int fail_after = -1;  ///< calls that succeed before it throws; -1: never

 private:
  torch::nn::Linear lin_;
};

class LinearHead : public models::Block {
 public:
  LinearHead(int64_t width, int64_t classes) : lin_(register_module("lin", torch::nn::Linear(width, classes))) {}
  torch::Tensor forward(const torch::Tensor& x) override { return lin_->forward(x); }

 private:
  torch::nn::Linear lin_;
};

}  // namespace strata::test
