// The device layer: side streams are asynchronous on every device (a worker thread on the CPU),
// events order work across streams, and allocator statistics move on CUDA.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <thread>

#include "correctness/support/test_device.h"
#include "models/check.h"
#include "models/model.h"
#include "strategies/device/device.h"
#include "strategies/pipeline/pipeline.h"

namespace strata {
namespace {

using namespace std::chrono_literals;

// oneDNN before 3.4 reads freed memory when it rebuilds an evicted CPU matmul primitive (device.h).
// Attaching a strategy, here one made without the registry and whose CPU stages run on threads,
// must leave such a oneDNN's cache too large to evict. The capacity is read back from oneDNN
// itself. CTest runs each test in a process of its own, so nothing armed the guard before.
TEST(Device, attaching_a_strategy_raises_an_affected_onednn_cache_so_it_never_evicts) {
  const int before = device::detail::onednn_cache_capacity();
  StrategyConfig config;
  config.device = test::device();
  Pipeline pipeline("pipeline", config, PipelineOptions::parse({{"devices", test::devices(2)}}));
  pipeline.attach(models::build_model(models::preset("gpt-tiny").config, 0));
  const int after = device::detail::onednn_cache_capacity();  // before this test calls the guard, which would arm it
  const auto& guard = device::guard_onednn_cache();
  std::cout << guard.summary << std::endl;
  if (!guard.affected) GTEST_SKIP() << guard.summary;
  if (!guard.variable.empty()) GTEST_SKIP() << "the capacity is the user's: " << guard.summary;
  EXPECT_EQ(after, device::kOnednnCacheCapacity) << guard.summary;
  EXPECT_EQ(guard.capacity, after);
  if (before != device::kOnednnCacheCapacity) {
    EXPECT_TRUE(guard.raised) << "before attach: " << before;
  }
}

TEST(Device, side_stream_copies_asynchronously_and_events_order_them) {
  const auto dev = test::device();
  auto side = device::Stream::side(dev);
  auto compute = device::Stream::compute(dev);
  auto src = device::host_buffer({1 << 20}, torch::kFloat, dev).fill_(3.0f);
  auto dst = torch::zeros({1 << 20}, torch::TensorOptions().device(dev));
  side.delay(std::chrono::microseconds(200000));
  side.copy(dst, src);
  auto done = side.record();
  // The copy waits behind a 200 ms delay, so the call above returned long before it ran.
  EXPECT_FALSE(done.done());
  compute.wait(done);
  EXPECT_EQ(dst.sum().item<float>(), 3.0f * (1 << 20));
  EXPECT_TRUE(done.done());
}

TEST(Device, injected_copy_delay_is_applied_and_restored) {
  const auto dev = test::device();
  auto side = device::Stream::side(dev);
  auto src = device::host_buffer({16}, torch::kFloat, dev).fill_(1.0f);
  auto dst = torch::zeros({16}, torch::TensorOptions().device(dev));
  {
    device::ScopedDelays delays({100ms, 0ms});
    EXPECT_EQ(device::injected_delays().copy, 100ms);
    const auto start = std::chrono::steady_clock::now();
    side.copy(dst, src);
    side.synchronize();
    EXPECT_GE(std::chrono::steady_clock::now() - start, 90ms);
  }
  EXPECT_EQ(device::injected_delays().copy, 0ms);
  EXPECT_EQ(dst.sum().item<float>(), 16.0f);
}

// Gradients go to the host piece by piece: each part lands in its own slice, in order, from
// the destination's start; the parts count as one transfer (one injected delay); parts that do
// not fill the destination exactly, or are not 1-D, are refused before anything is queued.
TEST(Device, copied_parts_land_in_consecutive_slices_as_one_transfer) {
  const auto dev = test::device();
  auto side = device::Stream::side(dev);
  auto compute = device::Stream::compute(dev);
  const auto on_dev = torch::TensorOptions().dtype(torch::kFloat).device(dev);
  std::vector<torch::Tensor> parts{torch::arange(0, 3, on_dev), torch::arange(10, 11, on_dev),
                                   torch::arange(20, 24, on_dev)};
  auto dst = device::host_buffer({8}, torch::kFloat, dev).fill_(-1.0f);
  {
    device::ScopedDelays delays({100ms, 0ms});
    side.wait(compute.record());  // the parts are made on the compute stream
    const auto start = std::chrono::steady_clock::now();
    side.copy_parts(dst, parts);
    side.synchronize();
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_GE(took, 90ms);
    EXPECT_LT(took, 250ms) << "three parts were delayed as three transfers";
  }
  const std::vector<float> expected{0, 1, 2, 10, 20, 21, 22, 23};
  EXPECT_TRUE(torch::equal(dst, torch::tensor(expected))) << dst;
  auto small = device::host_buffer({7}, torch::kFloat, dev);
  auto large = device::host_buffer({9}, torch::kFloat, dev);
  EXPECT_THROW(side.copy_parts(small, parts), strata::Error) << "parts that do not fit";
  EXPECT_THROW(side.copy_parts(large, parts), strata::Error) << "parts that leave the destination's end unwritten";
  EXPECT_THROW(side.copy_parts(dst, {torch::zeros({2, 4}, on_dev)}), strata::Error) << "a part that is not 1-D";

  // At offsets: each part in its own slice, in any order, the rest of dst as it was.
  auto spread = device::host_buffer({12}, torch::kFloat, dev).fill_(-1.0f);
  side.copy_parts(spread, parts, {9, 0, 4});
  side.synchronize();
  const std::vector<float> spread_expected{10, -1, -1, -1, 20, 21, 22, 23, -1, 0, 1, 2};
  EXPECT_TRUE(torch::equal(spread, torch::tensor(spread_expected))) << spread;
  EXPECT_THROW(side.copy_parts(spread, parts, {0, 3}), strata::Error) << "two offsets for three parts";
  EXPECT_THROW(side.copy_parts(spread, parts, {10, 0, 4}), strata::Error) << "a part past the destination's end";
  EXPECT_THROW(side.copy_parts(spread, parts, {-1, 0, 4}), strata::Error) << "a negative offset";
}

TEST(Device, a_held_side_stream_runs_nothing_until_its_gate_opens) {
  const auto dev = test::device();
  auto side = device::Stream::side(dev);
  auto src = device::host_buffer({16}, torch::kFloat, dev).fill_(2.0f);
  auto dst = torch::zeros({16}, torch::TensorOptions().device(dev));
  auto gate = std::make_shared<device::Gate>();
  side.hold(gate);
  side.copy(dst, src);
  auto done = side.record();
  std::this_thread::sleep_for(200ms);  // ample for a 64-byte copy that was not held
  EXPECT_FALSE(done.done()) << "a copy behind a closed gate ran";
  gate->open();
  done.synchronize();
  EXPECT_EQ(dst.sum().item<float>(), 32.0f);
  EXPECT_TRUE(gate->wait_for(0ms));
  EXPECT_THROW(device::Stream::compute(torch::kCPU).hold(std::make_shared<device::Gate>()), strata::Error);
}

TEST(Device, host_buffers_are_pinned_for_cuda) {
  const auto dev = test::device();
  auto h = device::host_buffer({8}, torch::kFloat, dev);
  EXPECT_TRUE(h.device().is_cpu());
  EXPECT_EQ(h.is_pinned(), dev.is_cuda());
}

TEST(Device, allocator_peak_tracks_an_allocation_on_cuda) {
  const auto dev = test::device();
  device::synchronize(dev);
  device::reset_peak_stats(dev);
  const auto before = device::allocator_stats(dev);
  {
    auto big = torch::empty({64 << 20}, torch::TensorOptions().dtype(torch::kByte).device(dev));
    device::synchronize(dev);
  }
  const auto after = device::allocator_stats(dev);
  if (dev.is_cuda()) {
    EXPECT_GE(after.peak_allocated - before.allocated, 64 << 20);
    EXPECT_LE(after.allocated, before.allocated);  // freed again
  } else {
    EXPECT_EQ(after.peak_allocated, 0) << "the CPU has no caching-allocator statistics";
  }
}

}  // namespace
}  // namespace strata
