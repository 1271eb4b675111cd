// strata_onednn_repro: shows the oneDNN use-after-free that device::guard_onednn_cache() keeps the
// suite away from (strategies/device/device.h), without any of strata's strategies.
//
// Rounds of short-lived threads run bf16 linears with a bias, forward and backward, over a pool of
// shapes, all at once: while one thread takes a matmul's primitive descriptor from oneDNN's cache,
// another evicts the primitive it came from, and the first builds the primitive again from a copy
// whose pointers lead into freed memory. On oneDNN before 3.4 a small cache makes this show within
// seconds (bad_alloc, bad_array_new_length or a segmentation fault); a cache that never evicts does
// not. Not a test: whether a given run meets the race is chance. bench/notes/onednn-cache-guard.md has measured runs.
// Built with the project, so it keeps compiling; run by hand.
//
//   strata_onednn_repro --capacity=64     evicting cache: fails on an affected oneDNN
//   strata_onednn_repro --guard           the guard's cache: passes
#include <torch/torch.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "strategies/device/device.h"

namespace {

int parse_count(const char* arg, const char* name, int min) {
  const std::string prefix = std::string("--") + name + "=";
  char* end = nullptr;
  const long value = std::strtol(arg + prefix.size(), &end, 10);
  if (end == arg + prefix.size() || *end != '\0' || value < min || value > (1 << 30)) {
    std::fprintf(stderr, "strata_onednn_repro: %s: expected a whole number of at least %d\n", arg, min);
    std::exit(2);
  }
  return static_cast<int>(value);
}

void linear_step(int64_t rows, int64_t in, int64_t out) {
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16);
  auto x = torch::randn({rows, in}, bf16).requires_grad_();
  auto w = torch::randn({out, in}, bf16).requires_grad_();
  auto b = torch::randn({out}, bf16).requires_grad_();
  torch::nn::functional::linear(x, w, b).sum().backward();
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 600, threads = 4, shapes = 128, per_thread = 16, capacity = -1;
  bool guard = false;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strncmp(a, "--rounds=", 9) == 0) rounds = parse_count(a, "rounds", 1);
    else if (std::strncmp(a, "--threads=", 10) == 0) threads = parse_count(a, "threads", 1);
    else if (std::strncmp(a, "--shapes=", 9) == 0) shapes = parse_count(a, "shapes", 1);
    else if (std::strncmp(a, "--per-thread=", 13) == 0) per_thread = parse_count(a, "per-thread", 1);
    else if (std::strncmp(a, "--capacity=", 11) == 0) capacity = parse_count(a, "capacity", 0);
    else if (std::strcmp(a, "--guard") == 0) guard = true;
    else {
      std::fprintf(stderr,
                   "strata_onednn_repro: unknown argument '%s'\n"
                   "usage: strata_onednn_repro [--capacity=N | --guard] [--rounds=600] [--threads=4] "
                   "[--shapes=128] [--per-thread=16]\n",
                   a);
      return 2;
    }
  }
  if (guard && capacity >= 0) {
    std::fprintf(stderr, "strata_onednn_repro: --guard and --capacity=%d exclude each other\n", capacity);
    return 2;
  }
  if (guard) std::printf("%s\n", strata::device::guard_onednn_cache().summary.c_str());
  if (capacity >= 0 && !strata::device::detail::set_onednn_cache_capacity(capacity)) {
    std::fprintf(stderr,
                 "strata_onednn_repro: --capacity=%d: oneDNN's C API is not among this process's symbols, or it "
                 "refused that capacity\n",
                 capacity);
    return 2;
  }
  const int current = strata::device::detail::onednn_cache_capacity();
  std::printf("oneDNN primitive cache capacity %d; %d rounds of %d threads, %d linears each, over %d shapes\n",
              current, rounds, threads, per_thread, shapes);
  std::fflush(stdout);

  at::set_num_threads(1);  // the threads here are the concurrency; keep each matmul on its own
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> dim(2, 48);
  std::vector<std::array<int64_t, 3>> pool;
  for (int i = 0; i < shapes; ++i) pool.push_back({dim(rng), dim(rng), dim(rng)});

  std::atomic<bool> failed{false};
  std::mutex print;
  for (int r = 0; r < rounds && !failed; ++r) {
    std::vector<std::thread> running;
    for (int t = 0; t < threads; ++t)
      running.emplace_back([&, r, t] {
        std::mt19937 pick(static_cast<unsigned>(r * 131 + t));
        try {
          for (int k = 0; k < per_thread; ++k) {
            const auto& s = pool[pick() % pool.size()];
            linear_step(s[0], s[1], s[2]);
          }
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(print);
          std::printf("round %d, thread %d: %s\n", r, t, e.what());
          failed = true;
        }
      });
    for (auto& t : running) t.join();
    if ((r + 1) % 100 == 0) std::printf("%d rounds passed\n", r + 1), std::fflush(stdout);
  }
  if (failed) {
    std::printf("FAILED: a bf16 linear threw (see above)\n");
    return 1;
  }
  std::printf("all %d rounds passed\n", rounds);
  return 0;
}
