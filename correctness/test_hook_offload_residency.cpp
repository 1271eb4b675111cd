// hook_offload, what stays on the device and for how long: nothing offloaded after a step, resident blocks,
// the seed's double-load scenario, peak memory under an analytic bound, the host's lead, buffers.
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
using offload_test::window_bytes;
using offload_test::expect_auto_opening;

// Peak memory during a step, against a bound derived from the schedule. For a chain of equal
// windows W (an MLP of 256 x 256 blocks) with prefetch p: in forward, block b's window and the p
// ahead of it are held, b's is dropped before b+1 computes; the merged last block stays through
// its own backward, which already prefetches p behind it. So at most (p + 1) W of parameters are
// resident at any moment: a window held one block too long makes it (p + 2) W.
struct PeakCase {
  models::ModelConfig config;
  int64_t window = 0;  ///< W: bytes of every block's window
  models::Batch batch;
};

PeakCase equal_windows() {
  models::ModelConfig c;
  c.kind = models::ModelKind::mlp;
  c.depth = 8;
  c.width = 256;
  c.in_features = 256;
  c.classes = 256;
  c.tied = false;
  auto model = models::build_model(c, 0);
  for (int64_t b = 1; b < model.num_blocks(); ++b) EXPECT_EQ(window_bytes(model, b), window_bytes(model, 0));
  return {c, window_bytes(model, 0), models::make_batch(c, 2, 1)};
}

struct Peak {
  int64_t params = 0;     ///< the strategy's own accounting
  int64_t allocated = 0;  ///< the allocator's, above what is allocated at rest (CUDA only)
};

Peak peak_of_a_step(const PeakCase& pc, const std::map<std::string, std::string>& options) {
  const auto dev = test::device();
  auto s = make_offload(options);
  s->attach(models::build_model(pc.config, 0));
  s->train_step(pc.batch);  // warm-up: library workspaces are allocated once and kept
  s->optimizer_step();
  device::synchronize(dev);
  const auto at_rest = device::allocator_stats(dev).allocated;
  s->reset_stats();
  s->train_step(pc.batch);
  s->finish_backward();
  device::synchronize(dev);
  const auto mem = s->stats().devices.at(dev.str());
  s->optimizer_step();
  return {mem.peak_param_bytes, mem.peak_allocated - at_rest};
}

TEST(HookOffload, nothing_offloaded_stays_on_the_device_after_forward_backward_and_step) {
  for (const char* activations : {"recompute", "keep"}) {
    for (int prefetch : {0, 1, 3}) {
      auto s = make_offload({{"prefetch", std::to_string(prefetch)}, {"activations", activations}});
      const auto config = gpt(3, 16);
      const auto model = models::build_model(config, 0);
      s->attach(models::build_model(config, 0));
      const auto dev = test::device();
      const auto batch = models::make_batch(config, 2, 1);
      // One step first: the math libraries keep workspaces (cuBLAS: tens of MiB) for good. Its
      // optimizer_step leaves the next forward's first windows on the device; a forward uses them.
      s->train_step(batch);
      s->optimizer_step();
      s->forward(batch.input);
      device::synchronize(dev);
      const auto allocated_at_rest = device::allocator_stats(dev).allocated;
      const std::string where = std::string(activations) + " prefetch=" + std::to_string(prefetch);

      s->forward(batch.input);
      EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << "after forward, " << where;
      EXPECT_EQ(HookOffloadTestPeer(*s).references_held(), 0) << "after forward, " << where;
      s->train_step(batch);
      EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << "after backward, " << where;
      EXPECT_EQ(HookOffloadTestPeer(*s).references_held(), 0) << "after backward, " << where;
      if (dev.is_cuda()) {
        // Not only by the strategy's own count: the allocator holds nothing more than at rest once
        // the gradients are on their way (the gradient tensors are freed when their copies finish).
        s->finish_backward();
        device::synchronize(dev);
        EXPECT_EQ(device::allocator_stats(dev).allocated, allocated_at_rest) << "after backward, " << where;
      }
      s->optimizer_step();
      // Only the windows the next forward opens with, fetched ahead (none without prefetch).
      const int64_t opening = expect_auto_opening(*s, model, prefetch, where);
      EXPECT_EQ(s->offloaded_bytes_on_device(), opening) << "after the step, " << where;
      s->forward(batch.input);
      EXPECT_EQ(s->offloaded_bytes_on_device(), 0) << "after the step and a forward, " << where;
      device::synchronize(dev);
      if (dev.is_cuda()) {
        // The allocator agrees: nothing the step allocated is still held.
        EXPECT_EQ(device::allocator_stats(dev).allocated, allocated_at_rest) << where;
      }
    }
  }
}

TEST(HookOffload, resident_blocks_stay_and_only_they_stay) {
  // prefetch=0: optimizer_step then fetches no window for the next forward, so after the step too
  // only the resident block is on the device.
  auto s = make_offload({{"resident", "1"}, {"prefetch", "0"}});
  const auto config = gpt(3, 16);
  auto model = models::build_model(config, 0);
  const int64_t resident = window_bytes(model, 1);
  s->attach(std::move(model));
  s->train_step(models::make_batch(config, 2, 1));
  EXPECT_EQ(s->offloaded_bytes_on_device(), 0);
  EXPECT_EQ(s->stats().devices.at(test::device().str()).resident_param_bytes, resident);
  s->optimizer_step();
  EXPECT_EQ(s->offloaded_bytes_on_device(), 0);
  EXPECT_EQ(s->stats().devices.at(test::device().str()).resident_param_bytes, resident);
}

// A resident block's copy is refreshed inside optimizer_step, as soon as its own update has run
// (beside the rest of the host pass), so the next forward does not open with that fetch: the step
// fetches block 0's window once (its bytes, counted in optimizer_step) and the next train_step
// none of it. Parity with resident blocks is the properties' (they draw resident=...).
TEST(HookOffload, a_resident_block_is_refreshed_in_the_optimizer_step) {
  // prefetch=0: no other window is fetched ahead by optimizer_step (the test above has those).
  auto s = make_offload({{"resident", "0"}, {"prefetch", "0"}});
  const auto config = gpt(3, 16);
  auto model = models::build_model(config, 0);
  const int64_t window0 = window_bytes(model, 0);
  s->attach(std::move(model));
  const auto batch = models::make_batch(config, 2, 1);
  s->train_step(batch);
  s->reset_stats();
  s->optimizer_step();
  EXPECT_EQ(s->stats().bytes_h2d, window0) << "the resident window was not refreshed by optimizer_step";
  s->reset_stats();
  s->train_step(batch);
  const auto with_resident = s->stats().bytes_h2d;
  s->optimizer_step();
  // The same bytes as a first step, when nothing was stale yet.
  auto fresh = make_offload({{"resident", "0"}, {"prefetch", "0"}});
  fresh->attach(models::build_model(config, 0));
  fresh->reset_stats();
  fresh->train_step(batch);
  EXPECT_EQ(with_resident, fresh->stats().bytes_h2d) << "the next train_step fetched the resident window again";
}

TEST(HookOffload, a_block_fetched_for_backward_and_again_for_its_recompute_is_released) {
  // Seed 003 loads a block in its backward pre-hook and again in the recompute's forward pre-hook,
  // then releases it once: the block stays on the device. Here the same two requests happen —
  // the backward prefetch of the previous block takes a reference, then that block's own backward
  // takes it again to recompute — and the tied embedding is held by two windows at once (prefetch
  // 4 reaches from the head back to the embedding). Every reference must be returned.
  auto s = make_offload({{"prefetch", "4"}, {"activations", "recompute"}});
  const auto config = gpt(2, 8);  // 4 blocks: the prefetch window covers the whole model
  s->attach(models::build_model(config, 0));
  const auto dev = test::device();
  const auto batch = models::make_batch(config, 2, 1);
  s->train_step(batch);
  EXPECT_EQ(HookOffloadTestPeer(*s).references_held(), 0);
  EXPECT_EQ(s->offloaded_bytes_on_device(), 0);
  // Peak residency shows the overlap really happened: more than one window at once.
  const auto peak = s->stats().devices.at(dev.str()).peak_param_bytes;
  EXPECT_GT(peak, window_bytes(models::build_model(config, 0), 1));
}

TEST(HookOffload, peak_memory_stays_under_the_analytic_bound_and_a_late_release_breaks_it) {
  const auto pc = equal_windows();
  const int64_t W = pc.window;
  for (int64_t p : {0, 1, 2}) {
    const std::map<std::string, std::string> options{{"prefetch", std::to_string(p)}};
    const auto right = peak_of_a_step(pc, options);
    EXPECT_LE(right.params, (p + 1) * W) << "prefetch=" << p;
    auto late_options = options;
    late_options["debug_release_late"] = "1";
    const auto late = peak_of_a_step(pc, late_options);
    EXPECT_GT(late.params, (p + 1) * W) << "prefetch=" << p << ": a window held one block too long went unnoticed";
    if (test::device().is_cuda()) {
      // The allocator sees the parameters above, plus gradients in flight: a block's gradients
      // (W), their flat copy for the host (W) and the previous block's flat still copying (W);
      // plus one dropped window whose memory waits for the compute that read it (W); plus
      // activations of a batch of 2 (a few KiB, allowed W / 8).
      const int64_t bound = (p + 1) * W + 4 * W + W / 8;
      EXPECT_LE(right.allocated, bound) << "prefetch=" << p;
      EXPECT_GE(late.allocated, right.allocated + W / 2) << "prefetch=" << p << ": the allocator did not see the late window";
    }
  }
}

// `lead` lets the host run further ahead of the device: a released window whose compute is still
// queued keeps its memory from reuse until that compute has run, so the allocator must reserve
// fresh memory for the next fetch. A compute delay at every block makes sure the host is ahead;
// windows of 16 MiB each take a segment of their own. The windows held do not change with it.
// CUDA only (CudaOnly.* is not listed for the CPU): there compute runs on the calling thread, so
// the host is never ahead.
TEST(CudaOnly, hook_offload_lead_keeps_more_released_windows_pending_on_the_device) {
  const auto dev = test::device();
  ASSERT_TRUE(dev.is_cuda()) << "CudaOnly tests need --device=cuda";
  models::ModelConfig c;
  c.kind = models::ModelKind::mlp;
  c.depth = 8;
  c.width = c.in_features = c.classes = 2048;
  c.tied = false;
  const int64_t W = window_bytes(models::build_model(c, 0), 1);
  const auto batch = models::make_batch(c, 2, 1);
  device::ScopedDelays delays({0ms, 20ms});
  struct Seen {
    int64_t params = 0, reserved = 0;
  };
  auto with_lead = [&](int64_t lead) {
    auto s = make_offload({{"prefetch", "1"}, {"lead", std::to_string(lead)}});
    s->attach(models::build_model(c, 0));
    s->train_step(batch);  // warm-up: optimizer state, library workspaces
    s->optimizer_step();
    device::release_cached_memory(dev);
    const auto at_rest = device::allocator_stats(dev).reserved;
    s->reset_stats();
    s->train_step(batch);
    s->finish_backward();
    device::synchronize(dev);
    const auto mem = s->stats().devices.at(dev.str());
    s->optimizer_step();
    return Seen{mem.peak_param_bytes, mem.peak_reserved - at_rest};
  };
  const auto one = with_lead(1), three = with_lead(3);
  EXPECT_LE(one.params, 2 * W);
  EXPECT_EQ(three.params, one.params) << "lead changed the windows held";
  EXPECT_GE(three.reserved, one.reserved + W)
      << "lead=3 reserved no more than lead=1 (window " << W << " bytes): the host did not run further ahead";
}

// Which blocks run their forward twice (once more in backward): the non-resident ones with
// activations=recompute, a resident one only with resident_activations=recompute. Counted on blocks
// that count their forward calls.
TEST(HookOffload, resident_blocks_recompute_only_when_asked) {
  models::ModelConfig config;
  config.kind = models::ModelKind::mlp;
  config.in_features = 4;
  config.classes = 3;
  const auto batch = models::Batch{torch::randn({6, 4}, torch::Generator(at::detail::createCPUGenerator(3))),
                                   torch::arange(6, torch::kLong) % 3};
  for (const char* resident_activations : {"keep", "recompute"}) {
    for (const char* activations : {"recompute", "keep"}) {
      std::vector<std::shared_ptr<test::FailingBlock>> counted;
      std::vector<std::shared_ptr<models::Block>> blocks;
      for (int b = 0; b < 3; ++b) {
        counted.push_back(std::make_shared<test::FailingBlock>(4));
        counted.back()->fail_after = 1 << 20;  // never fails; a block counts its calls only when armed
        blocks.push_back(counted.back());
      }
      blocks.push_back(std::make_shared<test::LinearHead>(4, 3));
      auto s = make_offload({{"resident", "1"}, {"resident_activations", resident_activations}, {"activations", activations}});
      s->attach(models::BlockModel(config, blocks));
      s->train_step(batch);
      s->optimizer_step();
      const std::string where = std::string("resident_activations=") + resident_activations + " activations=" + activations;
      const int offloaded = std::string(activations) == "recompute" ? 2 : 1;
      const int resident = std::string(resident_activations) == "recompute" ? 2 : 1;
      EXPECT_EQ(counted[0]->calls.load(), offloaded) << where << ": block 0 (offloaded)";
      EXPECT_EQ(counted[1]->calls.load(), resident) << where << ": block 1 (resident)";
      EXPECT_EQ(counted[2]->calls.load(), offloaded) << where << ": block 2 (offloaded)";
    }
  }
}

// resident_updates=device: the units only resident blocks use (here the GPT's tied embedding and
// head, blocks 0 and 4, and block 1's own) train on the device. In plain and overlapped mode, with
// a step that accumulates two batches (the parity check's second): parity with the baseline, and
// none of their gradients or values cross the link, which the same resident blocks trained on the
// host do every step.
TEST(HookOffload, units_trained_on_the_device_match_the_baseline_and_never_cross_the_link) {
  const auto config = gpt(3, 16);
  ASSERT_TRUE(config.tied);
  auto model = models::build_model(config, 0);
  ASSERT_EQ(model.num_blocks(), 5);
  int64_t on_device_bytes = 0, all_parameters = 0;
  for (const auto& p : model.parameters()) all_parameters += p.tensor.numel();
  {
    std::map<int64_t, std::set<int64_t>> users;  // parameter -> blocks
    const auto blocks = model.block_parameters();
    for (size_t b = 0; b < blocks.size(); ++b)
      for (auto p : blocks[b]) users[p].insert(static_cast<int64_t>(b));
    for (const auto& [p, bs] : users)
      if (std::all_of(bs.begin(), bs.end(), [](int64_t b) { return b == 0 || b == 1 || b == 4; }))
        on_device_bytes += model.parameters()[p].tensor.numel() * 4;
  }
  ASSERT_GT(on_device_bytes, 0);
  for (const auto* strategy : {"hook_offload", "hook_offload_overlap"}) {
    // Recomputed resident blocks too: block 0's recompute, last in backward, must read the tied
    // matrix before the overlapped mode's in-place device update of it (which its own gradient starts).
    for (const auto* resident_activations : {"keep", "recompute"}) {
      correctness::ParityCase c;
      c.model = config;
      c.steps = 3;
      c.options = {{"resident", "0,1,4"}, {"resident_updates", "device"}, {"resident_activations", resident_activations},
                   {"merge_last", "0"}};
      const auto r = correctness::check_parity(strategy, c, test::device());
      EXPECT_TRUE(r.ok) << strategy << " resident_activations=" << resident_activations << ": " << r.message;
    }

    const bool overlap = std::string(strategy) == "hook_offload_overlap";
    auto bytes = [&](const char* where) {
      auto s = make_offload({{"resident", "0,1,4"}, {"resident_updates", where}, {"overlap_optimizer", overlap ? "1" : "0"},
                             {"prefetch", "0"}});
      s->attach(models::build_model(config, 0));
      const auto batch = models::make_batch(config, 2, 1);
      s->train_step(batch);
      s->optimizer_step();
      s->reset_stats();
      s->train_step(batch);
      s->optimizer_step();
      const auto stats = s->stats();
      return std::make_tuple(stats.bytes_h2d, stats.bytes_d2h, stats.host_stepped_parameters);
    };
    const auto [h2d_host, d2h_host, stepped_host] = bytes("host");
    const auto [h2d_device, d2h_device, stepped_device] = bytes("device");
    // What the host optimizer steps (the report's host pass bytes): every parameter, or all but
    // those units'.
    EXPECT_EQ(stepped_host, all_parameters) << strategy;
    EXPECT_EQ(stepped_device, all_parameters - on_device_bytes / 4) << strategy;
    // On the host those units' gradients go down every step, and the tied matrix's touched rows
    // too (tied_rows: 14 of vocab 64, with their int64 indices), and, refreshed after their
    // update, their values come back up.
    const auto batch = models::make_batch(config, 2, 1);
    const int64_t tokens = std::get<0>(at::_unique(batch.input)).numel();
    ASSERT_LE(2 * tokens, config.vocab) << "the embedding's rows must be sparse here";
    EXPECT_EQ(d2h_host - d2h_device, on_device_bytes + tokens * (config.width * 4 + 8)) << strategy;
    EXPECT_EQ(h2d_host - h2d_device, on_device_bytes) << strategy;
    EXPECT_GT(d2h_device, 0) << strategy << ": the offloaded blocks' gradients still go to the host";
  }
}

TEST(HookOffload, buffers_live_on_the_device_and_a_recompute_updates_them_once) {
  const auto spec = correctness::ChainSpec::parse("chain(in=3 width=4 classes=3 blocks=lin,bn,table)");
  for (const char* activations : {"recompute", "keep"}) {
    auto s = make_offload({{"activations", activations}, {"merge_last", "0"}});
    s->attach(spec.build(0));
    for (const auto& b : s->model().buffers()) EXPECT_EQ(b.tensor.device(), test::device()) << b.name;
    s->train_step(spec.make_batch(4, 1));
    const auto buffers = s->buffers();
    const auto counter = std::find_if(buffers.begin(), buffers.end(),
                                      [](const auto& b) { return b.first == "2.norm.num_batches_tracked"; });
    ASSERT_NE(counter, buffers.end());
    EXPECT_EQ(counter->second.item<int64_t>(), 1) << activations;
    s->optimizer_step();
  }
}

}  // namespace
}  // namespace strata
