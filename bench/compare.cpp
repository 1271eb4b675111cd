// strata_compare: the main job. For every registered strategy (or those named), check parity with
// the baseline on a small batch, then time training steps on a model preset and print one table:
// loss parity, step time, and memory per strategy.
//
//   strata_compare [--model=PRESET] [--device=cpu|cuda:N] [--steps=N] [--batch=N]
//                  [--strategies=a,b] [--optimizer=sgd|adamw]
#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "correctness/support/parity.h"
#include "models/check.h"
#include "strategies/device/device.h"
#include "strategies/strategy.h"

namespace strata {
namespace {

struct Args {
  std::string model;
  std::string device = device::cuda_available() ? "cuda:0" : "cpu";
  int steps = 5;
  int64_t batch = 0;
  std::vector<std::string> strategies;
  std::string optimizer = "adamw";
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&](const char* key) -> const char* {
      const std::string prefix = std::string("--") + key + "=";
      return arg.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (const char* v = value("model")) a.model = v;
    else if (const char* v = value("device")) a.device = v;
    else if (const char* v = value("steps")) a.steps = std::atoi(v);
    else if (const char* v = value("batch")) a.batch = std::atoll(v);
    else if (const char* v = value("optimizer")) a.optimizer = v;
    else if (const char* v = value("strategies")) {
      std::stringstream in(v);
      std::string s;
      while (std::getline(in, s, ',')) a.strategies.push_back(s);
    } else {
      STRATA_CHECK(false, "unknown argument '" << arg
                              << "'; usage: strata_compare [--model=PRESET] [--device=cpu|cuda:N] [--steps=N] "
                                 "[--batch=N] [--strategies=a,b] [--optimizer=sgd|adamw]");
    }
  }
  STRATA_CHECK(a.steps >= 1, "--steps=" << a.steps << " must be at least 1");
  return a;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

int run(int argc, char** argv) {
  auto args = parse_args(argc, argv);
  const auto dev = device::parse(args.device);
  if (args.model.empty()) args.model = dev.is_cuda() ? "gpt-medium" : "gpt-tiny";
  const auto& preset = models::preset(args.model);
  const int64_t batch_size = args.batch > 0 ? args.batch : preset.batch_size;
  if (args.strategies.empty()) args.strategies = Registry::names();
  for (const auto& s : args.strategies) Registry::description(s);  // unknown names fail before any work

  at::globalContext().setAllowTF32CuBLAS(true);  // timing runs as users train: TF32 on
  StrategyConfig config;
  config.device = dev;
  config.optimizer.kind = parse_optimizer_kind(args.optimizer);
  config.optimizer.lr = 1e-4;

  std::printf("strata comparison: model %s (%s), batch %ld, %d timed steps, %s, device %s\n", preset.name.c_str(),
              preset.config.to_string().c_str(), static_cast<long>(batch_size), args.steps,
              config.optimizer.to_string().c_str(), dev.str().c_str());
  std::printf("%-22s %-8s %12s %12s %12s %12s %12s\n", "strategy", "parity", "step ms", "items/s", "peak alloc MiB",
              "h2d MiB/step", "d2h MiB/step");

  for (const auto& name : args.strategies) {
    // Parity first, on a small model: a strategy that is wrong is not timed.
    correctness::ParityCase small;
    small.model = models::preset(preset.config.kind == models::ModelKind::gpt   ? "gpt-tiny"
                                 : preset.config.kind == models::ModelKind::bert ? "bert-tiny"
                                                                                 : "mlp-tiny")
                      .config;
    const auto parity = correctness::check_parity(name, small, dev);
    if (!parity.ok) {
      std::printf("%-22s %-8s %s\n", name.c_str(), "FAIL", parity.message.c_str());
      continue;
    }
    std::fflush(stdout);
    try {
      auto strategy = Registry::create(name, config);
      auto model = models::build_model(preset.config, 0);
      const auto items = model.items_per_batch(batch_size);
      strategy->attach(std::move(model));
      auto batch = models::make_batch(preset.config, batch_size, 1);
      strategy->train_step(batch);  // warm-up
      strategy->optimizer_step();
      device::synchronize(dev);
      strategy->reset_stats();
      std::vector<double> times;
      for (int i = 0; i < args.steps; ++i) {
        const auto start = std::chrono::steady_clock::now();
        strategy->train_step(batch);
        strategy->optimizer_step();
        device::synchronize(dev);
        times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      }
      std::sort(times.begin(), times.end());
      const double median = times[times.size() / 2];
      const auto s = strategy->stats();
      int64_t peak = 0;
      for (const auto& [d, m] : s.devices) peak = std::max(peak, m.peak_allocated);
      std::printf("%-22s %-8s %12.2f %12.0f %14.1f %12.1f %12.1f\n", name.c_str(), "ok", median,
                  static_cast<double>(items) / (median / 1e3), mib(peak), mib(s.bytes_h2d) / args.steps,
                  mib(s.bytes_d2h) / args.steps);
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      const bool oom = what.find("out of memory") != std::string::npos;
      std::printf("%-22s %-8s %s\n", name.c_str(), "ok", oom ? "out of memory" : what.substr(0, 200).c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  try {
    return strata::run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "strata_compare: " << e.what() << std::endl;
    return 2;
  }
}
