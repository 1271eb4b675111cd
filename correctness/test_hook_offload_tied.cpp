// hook_offload, a tied matrix used twice (tied_rows): its first use sent at once, its last use's touched rows,
// the step split into a first part and a rows part, sent in row ranges (tied_chunks) and ahead of
// its fetch (tied_early), to the bit what the plain step computes.
// Shared helpers: correctness/support/hook_offload_testing.h.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <ATen/record_function.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include "correctness/support/parity.h"
#include "correctness/support/errors.h"
#include "correctness/support/failing_block.h"
#include "models/check.h"
#include "correctness/support/test_device.h"
#include "strategies/checkpoint.h"
#include "strategies/device/device.h"
#include "strategies/hook_offload/hook_offload.h"
#include "correctness/support/hook_offload_peer.h"
#include "correctness/support/hook_offload_testing.h"

namespace strata {
namespace {

using namespace std::chrono_literals;
using offload_test::make_offload;
using offload_test::gpt;
using offload_test::adamw;
using offload_test::OpenOnExit;
using offload_test::tied_early_bytes;
using offload_test::expect_same_steps;
using offload_test::with_failing_block;

// Two runs of the same steps, tied_early=0 then 1: the same loss and parameters after every step, to
// the bit, and steps that moved something.
void expect_same_steps(const std::vector<double> (&losses)[2], const std::vector<NamedTensors> (&params)[2]) {
  ASSERT_EQ(losses[0].size(), losses[1].size());
  for (size_t i = 0; i < losses[0].size(); ++i) {
    EXPECT_EQ(losses[0][i], losses[1][i]) << "step " << i;
    ASSERT_EQ(params[0][i].size(), params[1][i].size());
    for (size_t k = 0; k < params[0][i].size(); ++k)
      EXPECT_TRUE(torch::equal(params[0][i][k].second, params[1][i][k].second))
          << "step " << i << ": " << params[0][i][k].first;
  }
  EXPECT_NE(losses[1].front(), losses[1].back()) << "the steps moved nothing";
}

// Four complete steps on the batches seeded first_seed, first_seed + 1, ...: each one's loss and the
// parameters after its optimizer step appended, for expect_same_steps.
void take_steps(HookOffload& s, const models::ModelConfig& config, int first_seed, std::vector<double>& losses,
                       std::vector<NamedTensors>& params) {
  for (int step = 0; step < 4; ++step) {
    losses.push_back(s.train_step(models::make_batch(config, 2, first_seed + step)));
    s.optimizer_step();
    params.push_back(s.parameters());
  }
}

// tied_chunks: the tied matrix's first part starts once its first range has landed and waits for
// each later one; those waits are not host work either. Every copy is delayed 40 ms here, so the
// three later ranges keep the first part waiting ~120 ms a step; the host's work on this model is
// a few ms.
TEST(HookOffload, host_update_time_leaves_out_the_wait_for_a_tied_gradients_later_ranges) {
  device::ScopedDelays delays({40ms, 0ms});
  const auto config = gpt(2, 8, 64);
  auto s = make_offload({{"overlap_optimizer", "1"}, {"tied_chunks", "4"}});
  s->attach(models::build_model(config, 0));
  s->train_step(models::make_batch(config, 2, 1));
  s->optimizer_step();
  s->finish_step();
  s->reset_stats();
  s->train_step(models::make_batch(config, 2, 2));
  s->optimizer_step();
  s->finish_step();
  EXPECT_EQ(HookOffloadTestPeer(*s).ranged_first_parts(), 2);
  const double host_ms = s->stats().host_update_ms;
  EXPECT_GT(host_ms, 0.0);
  EXPECT_LT(host_ms, 60.0) << "the wait for the later ranges was counted as host work";
}

// tied_chunks=auto (the default, and named): the head's gradient of the tied matrix goes in ranges
// where the compute dtype is fp32 and as one copy under bf16; an explicit count holds in either.
TEST(HookOffload, tied_chunks_auto_sends_ranges_in_fp32_and_one_copy_in_bf16) {
  const auto config = gpt(2, 8, 64);
  struct Case {
    std::string precision;
    std::map<std::string, std::string> options;
    int64_t ranged;
  };
  const Case cases[] = {{"fp32", {}, 2},
                        {"fp32", {{"tied_chunks", "auto"}}, 2},
                        {"bf16", {}, 0},
                        {"bf16", {{"tied_chunks", "auto"}}, 0},
                        {"fp32", {{"tied_chunks", "1"}}, 0},
                        {"bf16", {{"tied_chunks", "4"}}, 2}};
  for (const auto& c : cases) {
    auto options = c.options;
    options["overlap_optimizer"] = "1";
    const std::string where = c.precision + ", tied_chunks=" + (c.options.empty() ? "(default)" : c.options.at("tied_chunks"));
    auto base = adamw();
    base.precision = PrecisionPolicy::parse(c.precision);
    auto s = make_offload(options, base);
    s->attach(models::build_model(config, 0));
    for (int step = 0; step < 2; ++step) {
      s->train_step(models::make_batch(config, 2, step + 1));
      s->optimizer_step();
    }
    s->finish_step();
    EXPECT_EQ(HookOffloadTestPeer(*s).ranged_first_parts(), c.ranged) << where;
  }
}

// tied_rows changes how a tied matrix's gradient reaches the host and, in the overlapped mode, when
// its step is taken and into which buffer; never the step. With AdamW (whose parity allowance grows
// with the learning rate, so a row stepped twice, or from the wrong start, could pass the parity
// suite) the parameters after each of three steps from no optimizer state must be the same to the
// bit with tied_rows on and off: in plain mode, in the overlapped mode, and there with the updates
// held until backward has ended (every part then runs after every gradient has landed), and there
// with tied_early=1 (the matrix sent early, its rows after; the overlapped mode's default fetches
// it whole, and the held mode cannot send it early). Vocab 64 and 14 distinct tokens: the
// embedding's last use is sparse, so the rows are what travels.
TEST(HookOffload, tied_rows_never_changes_the_step) {
  const auto config = gpt(3, 8, 64);
  const auto base = adamw();
  for (const std::string mode : {"plain", "overlap", "overlap, held", "overlap, tied_early=1"}) {
    std::vector<NamedTensors> trajectory[2];
    int64_t d2h[2] = {0, 0};
    for (int rows : {0, 1}) {
      std::map<std::string, std::string> options{{"tied_rows", std::to_string(rows)}};
      if (mode != "plain") options["overlap_optimizer"] = "1";
      if (mode == "overlap, tied_early=1") options["tied_early"] = "1";
      auto s = make_offload(options, base);
      s->attach(models::build_model(config, 0));
      for (int step = 0; step < 3; ++step) {
        auto gate = std::make_shared<device::Gate>();
        OpenOnExit open_on_exit{gate};
        if (mode == "overlap, held") HookOffloadTestPeer(*s).hold_updates(gate);
        s->train_step(models::make_batch(config, 2, step + 1));
        gate->open();
        s->optimizer_step();
        trajectory[rows].push_back(s->parameters());
      }
      d2h[rows] = s->stats().bytes_d2h;
    }
    EXPECT_GT(d2h[1], d2h[0]) << mode << ": with tied_rows=1 the rows did not travel";
    for (int step = 0; step < 3; ++step) {
      const auto& off = trajectory[0][step];
      const auto& on = trajectory[1][step];
      ASSERT_EQ(off.size(), on.size());
      for (size_t i = 0; i < off.size(); ++i)
        EXPECT_TRUE(torch::equal(off[i].second, on[i].second))
            << mode << ", step " << step << ": " << off[i].first << " differs by "
            << (off[i].second - on[i].second).abs().max().item<double>();
    }
    // The steps moved every parameter (a test that compares two frozen models proves nothing).
    for (size_t i = 0; i < trajectory[1][0].size(); ++i)
      EXPECT_FALSE(torch::equal(trajectory[1][0][i].second, trajectory[1][2][i].second)) << mode << ": " << trajectory[1][0][i].first;
  }
}

// tied_early: a rows part that fails after its step but before it gathers the rows leaves the next
// fetch nothing to send but the whole matrix. Every step that succeeds, before and after the error
// is reported (by optimizer_step or the next train_step, whichever comes after it), computes what
// the same steps compute with tied_early=0: their losses are equal to the bit, and the error is
// reported once. (Seen failing with the fetch sending the rows it was never given.)
TEST(HookOffload, a_rows_part_that_fails_before_its_gather_leaves_the_whole_matrix_to_fetch) {
  const auto config = gpt(2, 8, 64);
  const auto base = adamw();
  std::vector<double> losses[2];
  int errors[2] = {0, 0};
  for (int early : {0, 1}) {
    const std::string where = "tied_early=" + std::to_string(early);
    auto s = make_offload({{"overlap_optimizer", "1"}, {"tied_early", std::to_string(early)}}, base);
    s->attach(models::build_model(config, 0));
    for (int step = 0; step < 4; ++step) {
      if (step == 1) HookOffloadTestPeer(*s).fail_next_gather();  // tied_early=0 gathers nothing: it never fires there
      const auto batch = models::make_batch(config, 2, step + 1);
      bool ran = false;
      for (int attempt = 0; attempt < 2 && !ran; ++attempt) {
        try {
          losses[early].push_back(s->train_step(batch));
          ran = true;
        } catch (const std::exception&) {  // the error reported at the start of the next step
          ++errors[early];
        }
      }
      ASSERT_TRUE(ran) << where << ": step " << step << " failed twice";
      try {
        s->optimizer_step();
      } catch (const std::exception&) {  // or here, once the step's bookkeeping is done
        ++errors[early];
      }
    }
    s->parameters();  // every update has run
  }
  EXPECT_EQ(errors[0], 0);
  EXPECT_EQ(errors[1], 1) << "the injected failure was not reported, or not once";
  ASSERT_EQ(losses[0].size(), losses[1].size());
  for (size_t i = 0; i < losses[0].size(); ++i) EXPECT_EQ(losses[0][i], losses[1][i]) << "step " << i;
  EXPECT_NE(losses[1].front(), losses[1].back()) << "the steps moved nothing";
}

// tied_early: the early copy reads the buffer the tied matrix's first part writes, so it must wait
// for that part. Here every first part sleeps 50 ms on the host before its step, long past the end
// of backward on these small models: steps with tied_early must still compute what tied_early=0's
// do, to the bit (loss and parameters after each of four steps).
TEST(HookOffload, an_early_tied_copy_waits_for_a_slow_first_part) {
  const auto config = gpt(2, 8, 64);
  const auto base = adamw();
  std::vector<double> losses[2];
  std::vector<NamedTensors> params[2];
  for (int early : {0, 1}) {
    auto s = make_offload({{"overlap_optimizer", "1"}, {"tied_early", std::to_string(early)}}, base);
    s->attach(models::build_model(config, 0));
    HookOffloadTestPeer(*s).slow_first_parts(50ms);
    take_steps(*s, config, 1, losses[early], params[early]);
  }
  expect_same_steps(losses, params);
}

// tied_early: once a last use of the tied matrix was seen sparse, its early copy goes at the first
// backward block boundary after the first part has ended (here each boundary waits for that part,
// so it surely has), not at the end of backward, where the rows part had to wait for the copy's
// read of its buffer. None in the first step (nothing seen yet), one in each step after; the same
// bytes cross the link as when it goes at the end; and the steps compute what tied_early=0's do, to
// the bit, with every fetched buffer poisoned first.
TEST(HookOffload, an_early_tied_copy_goes_during_backward_once_the_last_use_was_sparse) {
  auto config = gpt(3, 8);
  config.vocab = 64;  // 16 tokens touch at most a quarter of the rows
  const auto base = adamw();
  std::vector<double> losses[2];
  std::vector<NamedTensors> params[2];
  for (int early : {0, 1}) {
    auto s = make_offload({{"overlap_optimizer", "1"}, {"tied_early", std::to_string(early)}, {"debug_poison", "1"}}, base);
    s->attach(models::build_model(config, 0));
    HookOffloadTestPeer(*s).await_first_parts_in_backward(true);
    int64_t h2d_first = 0;
    for (int step = 0; step < 4; ++step) {
      const auto batch = models::make_batch(config, 2, 1);  // the same tokens: the same bytes each step
      s->reset_stats();
      losses[early].push_back(s->train_step(batch));
      const auto h2d = s->stats().bytes_h2d;
      s->optimizer_step();
      params[early].push_back(s->parameters());
      const std::string where = "tied_early=" + std::to_string(early) + ", step " + std::to_string(step);
      EXPECT_EQ(HookOffloadTestPeer(*s).early_copies_in_backward(), early ? step : 0) << where;
      if (early) {
        const auto bytes = tied_early_bytes(s->model(), batch);
        ASSERT_GT(bytes.matrix, 0) << where;
        if (step == 0) h2d_first = h2d;  // the whole matrix fetched, and sent early at backward's end
        else EXPECT_EQ(h2d, h2d_first - bytes.matrix + bytes.rows) << where << ": its rows fetched, the matrix sent early";
      }
    }
  }
  expect_same_steps(losses, params);
}

// tied_early: a backward that fails between the head and the embedding, after the tied matrix's
// first part ran, leaves that part's "done" behind (no rows part comes to reset it). The next step's
// early copy must still wait for its own first part, here slow (50 ms, from the failing step on:
// so the failing step sent none during its backward, and the matrix stays seen as sparse). Both
// runs, tied_early 0 and 1, go through the same complete step, the failure and four steps after
// it: the same losses and parameters, to the bit. Once with the head's gradient sent whole, once
// in four row ranges (tied_chunks=4, whose first part the failed backward leaves behind too).
TEST(HookOffload, an_early_tied_copy_after_a_failed_backward_waits_for_its_own_first_part) {
  auto config = gpt(3, 8);
  config.vocab = 64;
  for (const std::string chunks : {"1", "4"}) {
    SCOPED_TRACE("tied_chunks=" + chunks);
    std::vector<double> losses[2];
    std::vector<NamedTensors> params[2];
    for (int early : {0, 1}) {
      std::shared_ptr<test::FailingBlock> failing;  // in place of the second of three blocks
      auto s = make_offload({{"overlap_optimizer", "1"}, {"tied_early", std::to_string(early)}, {"debug_poison", "1"},
                             {"tied_chunks", chunks}},
                            adamw());
      s->attach(with_failing_block(models::build_model(config, 0), 2, config.width, &failing));
      const auto batch = models::make_batch(config, 2, 1);
      s->train_step(batch);  // the last use seen sparse
      s->optimizer_step();
      HookOffloadTestPeer(*s).slow_first_parts(50ms);
      failing->calls = 0;
      failing->fail_after = 1;  // its forward runs; its recompute in backward throws, after the head's
      EXPECT_THROW(s->train_step(batch), std::exception);
      failing->fail_after = -1;
      take_steps(*s, config, 2, losses[early], params[early]);
    }
    expect_same_steps(losses, params);
  }
}

// tied_chunks: the tied matrix's first-use gradient goes to the host in row ranges and the first
// part steps each range once its copy has landed. Every copy is delayed 5 ms here, so the later
// ranges land well after the first part has started: a part that stepped a range before its copy
// landed would read the previous step's gradient there. The steps equal tied_chunks=1's to the
// bit (loss and parameters after each of four steps): with fp32 and with bf16 compute (whose
// first part also writes the bf16 copy that travels), with and without tied_early, for AdamW and
// for SGD with momentum (whose first step starts from no momentum at all), in 4 ranges of the 64
// rows, in 3 uneven ones, and asked for 100 (one a row); and the ranges did go (one ranged first
// part a step).
TEST(HookOffload, a_tied_first_part_in_row_ranges_steps_each_range_once_it_has_landed) {
  device::ScopedDelays delays({5ms, 0ms});
  const auto config = gpt(2, 8, 64);
  struct Case {
    std::string precision, early, optimizer, chunks;
  };
  const Case cases[] = {{"fp32", "0", "adamw", "4"}, {"fp32", "1", "adamw", "4"}, {"bf16", "0", "adamw", "4"},
                        {"bf16", "1", "adamw", "4"}, {"fp32", "0", "adamw", "3"}, {"fp32", "0", "adamw", "100"},
                        {"fp32", "0", "sgd", "4"}};
  for (const auto& c : cases) {
    const std::string where = c.precision + ", tied_early=" + c.early + ", " + c.optimizer + ", tied_chunks=" + c.chunks;
    SCOPED_TRACE(where);
    std::vector<double> losses[2];
    std::vector<NamedTensors> params[2];
    for (int ranged : {0, 1}) {
      auto base = adamw();
      if (c.optimizer == "sgd") {
        base.optimizer.kind = OptimizerKind::sgd;
        base.optimizer.momentum = 0.9;
      }
      base.precision = PrecisionPolicy::parse(c.precision);
      auto s = make_offload({{"overlap_optimizer", "1"}, {"tied_early", c.early}, {"tied_chunks", ranged ? c.chunks : "1"}}, base);
      s->attach(models::build_model(config, 0));
      take_steps(*s, config, 1, losses[ranged], params[ranged]);
      EXPECT_EQ(HookOffloadTestPeer(*s).ranged_first_parts(), ranged ? 4 : 0);
    }
    expect_same_steps(losses, params);
  }
}

}  // namespace
}  // namespace strata
