#pragma once
// What the multi-process tests of buffers share: a list of tensors the same on every rank, to the
// bit, and a model set to a strategy's state, whose own forward gives the buffers to expect.
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "strategies/distributed/process_group.h"
#include "strategies/strategy.h"

namespace strata::test {

/// Fails on every rank (naming the first that differs) unless `list` is the same on every rank of
/// `device`'s group, value for value.
inline void expect_the_same_on_every_rank(const std::string& topic, const NamedTensors& list, const torch::Device& device) {
  std::ostringstream text;
  text << std::hexfloat;
  for (const auto& [name, t] : list) {
    const auto d = t.to(torch::kDouble).contiguous();
    text << name << ":";
    for (int64_t i = 0; i < d.numel(); ++i) text << d.data_ptr<double>()[i] << ",";
  }
  EXPECT_NO_THROW(distributed::group_for(device)->agree(topic, text.str())) << topic;
}

/// `model`'s parameters and buffers set to those a strategy reported.
inline void set_state(models::BlockModel& model, const NamedTensors& params, const NamedTensors& buffers) {
  torch::NoGradGuard no_grad;
  ASSERT_EQ(params.size(), model.parameters().size());
  ASSERT_EQ(buffers.size(), model.buffers().size());
  for (size_t i = 0; i < params.size(); ++i) model.parameters()[i].tensor.copy_(params[i].second);
  for (size_t i = 0; i < buffers.size(); ++i) model.buffers()[i].tensor.copy_(buffers[i].second);
}

/// `have` (a strategy's buffers) against `model`'s, within rounding (the same operations on the
/// same values, through other code).
inline void expect_buffers_of(const models::BlockModel& model, const NamedTensors& have, const std::string& what) {
  ASSERT_EQ(have.size(), model.buffers().size()) << what;
  for (size_t i = 0; i < have.size(); ++i) {
    const auto want = model.buffers()[i].tensor.detach().cpu().to(torch::kDouble);
    const auto got = have[i].second.to(torch::kDouble);
    EXPECT_TRUE(torch::allclose(got, want, 1e-6, 1e-7))
        << what << ": buffer '" << have[i].first << "' is " << got << " but the model's own forward gives " << want;
  }
}

}  // namespace strata::test
