// strata_compare: the main job. For every registered strategy (or those named), check parity with
// the baseline on a small batch, then time training steps on a model preset and print one table:
// loss parity, step time, and memory per strategy.
//
//   strata_compare [--model=PRESET] [--device=cpu|cuda:N] [--steps=N] [--batch=N]
//                  [--strategies=a,b] [--optimizer=sgd|adamw] [--precision=P] [--inference] [--no-tf32]
//                  [--classes=N] [--options='key=value;strategy:key=value'] [--profile=DIR]
//                  [--profile-steps=N]
//
// Exit status: 0 when every strategy passed parity and ran (or ran out of memory, a result); 1 when
// any failed parity or errored; 2 for bad arguments.
//
// Training: median over the timed steps of forward+backward (train_step) and of the optimizer
// step, each timed to the completion of every device. --inference times forward() only and reports the
// host-to-device bandwidth it achieved (bytes moved / time).
//
// --profile=DIR: after the timed steps, one more forward+backward of each strategy is recorded with
// LibTorch's profiler into DIR/<strategy>.trace.json (Chrome trace; bench/kernel_table.py tabulates
// its kernels beside a peer's, bench/profile.sh runs both sides). --profile-steps=N records N
// whole steps instead (forward+backward and optimizer step each, back to back, then the device
// synchronized): what an overlapped optimizer leaves to the next step's forward, and the waits it
// causes there, fall inside the trace. Either way the recording starts after the timed steps' host
// updates have run and stops after the recorded ones' have (finish_step).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>

#include "bench/common.h"
#include "bench/profile.h"
#include "models/check.h"
#include "strategies/device/device.h"
#include "strategies/options.h"
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
  bool inference = false;
  bool tf32 = true;
  int64_t classes = 0;                        ///< overrides the preset's class count
  std::map<std::string, std::string> options; ///< key=value for every strategy, or strategy:key=value for one
  PrecisionPolicy precision;                  ///< fp32 by default
  std::string profile_dir;                    ///< where one profiled forward+backward per strategy goes
  int profile_steps = 0;                      ///< whole steps profiled instead (0: one forward+backward)
};

constexpr const char* kUsage =
    "usage: strata_compare [--model=PRESET] [--device=cpu|cuda:N] [--steps=N] [--batch=N] [--strategies=a,b]\n"
    "                      [--optimizer=sgd|adamw] [--precision=P] [--inference] [--no-tf32] [--classes=N]\n"
    "                      [--options='k=v;strategy:k=v'] [--profile=DIR [--profile-steps=N]]\n"
    "                      | --list[=markdown] | --help\n"
    "Checks each strategy's parity with the baseline, then times training steps of the model and prints\n"
    "one table: step, forward+backward and optimizer time, peak memory per device, bytes moved.\n"
    "  --model       a preset (--list shows them; default gpt-cpu on the CPU, gpt-medium on a GPU)\n"
    "  --strategies  registered strategies, comma-separated (default: every one that needs no options)\n"
    "  --options     options for every strategy, or strategy:key=value for one, ';'-separated\n"
    "  --precision   as strata_bench's: fp32, bf16, fp16, with overrides (bf16,transfer=fp32)\n"
    "  --inference   forward only; --no-tf32: full fp32 matrix products on the GPU\n"
    "  --profile     one profiled forward+backward per strategy, as Chrome traces in DIR\n"
    "  --profile-steps  N whole steps profiled instead, back to back (forward+backward and optimizer step)\n"
    "  --list        strategies with their options and defaults, and the presets (=markdown: the\n"
    "                options as docs/options.md's table)\n";

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::printf("%s%s", kUsage, bench::kExitStatuses);
      std::exit(0);
    }
    if (arg == "--list") {
      bench::print_list();
      std::exit(0);
    }
    if (arg == "--list=markdown") {  // docs/options.md's table of options
      bench::print_options_markdown();
      std::exit(0);
    }
    auto value = [&](const char* key) -> const char* {
      const std::string prefix = std::string("--") + key + "=";
      return arg.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (const char* v = value("model")) a.model = v;
    else if (const char* v = value("device")) a.device = v;
    else if (const char* v = value("steps")) a.steps = static_cast<int>(bench::int_arg("steps", v));
    else if (const char* v = value("batch")) a.batch = bench::int_arg("batch", v);
    else if (const char* v = value("optimizer")) a.optimizer = v;
    else if (const char* v = value("precision")) a.precision = PrecisionPolicy::parse(v);
    else if (arg == "--inference") a.inference = true;
    else if (const char* v = value("classes")) a.classes = bench::int_arg("classes", v);
    else if (const char* v = value("options")) a.options = bench::parse_options_arg(v);
    else if (arg == "--no-tf32") a.tf32 = false;
    else if (const char* v = value("profile-steps")) {
      const int64_t n = bench::int_arg("profile-steps", v);
      STRATA_CHECK(n >= 0 && n <= 1000, "--profile-steps=" << n << " must be 0 (one forward+backward) to 1000");
      a.profile_steps = static_cast<int>(n);
    }
    else if (const char* v = value("profile")) a.profile_dir = v;
    else if (const char* v = value("strategies")) {
      a.strategies = split(v);
    } else {
      STRATA_FAIL("unknown argument '" << arg << "' (strata_compare --help lists the arguments)");
    }
  }
  STRATA_CHECK(a.steps >= 1, "--steps=" << a.steps << " must be at least 1");
  STRATA_CHECK(a.profile_steps == 0 || !a.profile_dir.empty(), "--profile-steps=" << a.profile_steps << " needs --profile=DIR");
  STRATA_CHECK(a.profile_steps == 0 || !a.inference, "--profile-steps profiles training steps; not with --inference");
  return a;
}

int run(int argc, char** argv) {
  auto args = parse_args(argc, argv);
  const auto dev = device::parse(args.device);
  if (args.model.empty()) args.model = dev.is_cuda() ? "gpt-medium" : "gpt-cpu";
  auto preset = models::preset(args.model);
  if (args.classes > 0) {
    preset.config.classes = args.classes;
    preset.config.validate();
  }
  const int64_t batch_size = args.batch > 0 ? args.batch : preset.batch_size;
  if (args.strategies.empty()) args.strategies = Registry::default_names();
  for (const auto& s : args.strategies) Registry::description(s);  // unknown names fail before any work

  at::globalContext().setAllowTF32CuBLAS(args.tf32);  // timing runs as users train: TF32 on by default
  at::globalContext().setAllowTF32CuDNN(args.tf32);
  StrategyConfig config;
  config.device = dev;
  config.optimizer.kind = parse_optimizer_kind(args.optimizer);
  config.optimizer.lr = 1e-4;
  config.precision = args.precision;

  std::printf("strata comparison: model %s (%s), batch %ld, %d timed %s, %s, device %s, tf32 %s, precision %s\n",
              preset.name.c_str(), preset.config.to_string().c_str(), static_cast<long>(batch_size), args.steps,
              args.inference ? "forward passes" : "steps", config.optimizer.to_string().c_str(), dev.str().c_str(),
              args.tf32 ? "on" : "off", args.precision.to_string().c_str());
  // The CPU allocator keeps no statistics: there the memory columns are the strategy's own account
  // of parameter bytes on the device (peak, and resident after the steps), in units that fit them.
  const bool accounted = !dev.is_cuda();
  const double gb = 1e9, gib = 1024.0 * 1024.0 * 1024.0;
  const double mem_unit = accounted ? gib / 1024.0 : gib;
  const double byte_unit = accounted ? gb / 1000.0 : gb;
  const char* peak_head = accounted ? "param MiB" : "peak GiB";
  const char* second_head = accounted ? "held MiB" : "resv GiB";
  const char* moved_unit = accounted ? "MB" : "GB";
  if (accounted)
    std::printf("memory: parameter bytes the strategy holds on the device, by its own account (peak, and held\n"
                "after the last step); the CPU allocator keeps no statistics\n");
  if (args.inference)
    std::printf("%-22s %-6s %10s %12s %10s %10s %10s\n", "strategy", "parity", "fwd ms", "items/s", peak_head,
                (std::string("H2D ") + moved_unit).c_str(), "H2D GB/s");
  else
    std::printf("%-22s %-6s %10s %10s %10s %12s %10s %10s %9s %9s\n", "strategy", "parity", "fwd+bwd ms", "optim ms",
                "step ms", "items/s", peak_head, second_head, (std::string("H2D ") + moved_unit).c_str(),
                (std::string("D2H ") + moved_unit).c_str());
  std::fflush(stdout);

  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  auto now = [] { return std::chrono::steady_clock::now(); };
  auto ms_since = [&](auto start) { return std::chrono::duration<double, std::milli>(now() - start).count(); };

  // Strategies over several devices also get one line of peaks per device under their row.
  auto print_per_device = [&](const Stats& s) {
    if (s.devices.size() < 2) return;
    if (accounted) {
      std::printf("%-22s per device, peak / held parameter MiB:", "");
      for (const auto& [d, m] : s.devices)
        std::printf("  %s %.2f / %.2f", d.c_str(), m.peak_param_bytes / mem_unit, m.resident_param_bytes / mem_unit);
    } else {
      std::printf("%-22s per device, peak allocated / reserved GiB:", "");
      for (const auto& [d, m] : s.devices) std::printf("  %s %.2f / %.2f", d.c_str(), m.peak_allocated / gib, m.peak_reserved / gib);
    }
    std::printf("\n");
  };

  int failed = 0;  // rows whose parity failed or whose timing errored: the exit status
  for (const auto& name : args.strategies) {
    // Parity first, on a small model: a strategy that is wrong is not timed.
    config.options = bench::options_for(args.options, name);
    const std::string label = bench::label_with_options(name, config.options);
    correctness::ParityResult parity;
    try {
      parity = bench::check_before_timing(name, preset.config, config.options, dev, args.precision);
    } catch (const std::exception& e) {
      parity = {false, std::string("the check could not run: ") + e.what()};
    }
    if (!parity.ok) {
      std::printf("%-22s %-6s %s\n", label.c_str(), "FAIL", parity.message.c_str());
      ++failed;
      continue;
    }
    std::fflush(stdout);
    try {
      // Memory the previous strategy left cached would count as this one's reserved bytes.
      device::release_cached_memory(dev);
      auto strategy = Registry::create(name, config);
      auto model = models::build_model(preset.config, 0);
      const auto items = model.items_per_batch(batch_size);
      strategy->attach(std::move(model));
      auto batch = models::make_batch(preset.config, batch_size, 1);
      if (args.inference) {
        strategy->forward(batch.input);  // warm-up
        device::synchronize_all();
        strategy->reset_stats();
        std::vector<double> times;
        for (int i = 0; i < args.steps; ++i) {
          const auto start = now();
          strategy->forward(batch.input);
          device::synchronize_all();
          times.push_back(ms_since(start));
        }
        const double t = median(times);
        const auto s = strategy->stats();
        const auto peaks = bench::peaks_of(s);
        const int64_t peak = accounted ? peaks.params : peaks.allocated;
        const double h2d = static_cast<double>(s.bytes_h2d) / args.steps;
        std::printf("%-22s %-6s %10.2f %12.0f %10.2f %10.3f %10.1f\n", label.c_str(), "ok", t,
                    static_cast<double>(items) / (t / 1e3), peak / mem_unit, h2d / byte_unit, h2d / gb / (t / 1e3));
        print_per_device(s);
      } else {
        bench::warm_up(*strategy, batch);
        std::vector<double> fb, opt, step;
        for (int i = 0; i < args.steps; ++i) {
          const auto start = now();
          strategy->train_step(batch);
          strategy->finish_backward();
          device::synchronize_all();
          fb.push_back(ms_since(start));
          const auto mid = now();
          strategy->optimizer_step();
          device::synchronize_all();
          opt.push_back(ms_since(mid));
          step.push_back(ms_since(start));
        }
        const auto s = strategy->stats();
        const auto peaks = bench::peaks_of(s);
        const double t = median(step);
        int64_t held = 0;
        for (const auto& [d, m] : s.devices) held = std::max(held, m.resident_param_bytes);  // as peaks: the fullest device
        const double first = static_cast<double>(accounted ? peaks.params : peaks.allocated) / mem_unit;
        const double second = static_cast<double>(accounted ? held : peaks.reserved) / mem_unit;
        std::printf("%-22s %-6s %10.2f %10.2f %10.2f %12.0f %10.2f %10.2f %9.3f %9.3f\n", label.c_str(), "ok",
                    median(fb), median(opt), t, static_cast<double>(items) / (t / 1e3), first, second,
                    static_cast<double>(s.bytes_h2d) / args.steps / byte_unit,
                    static_cast<double>(s.bytes_d2h) / args.steps / byte_unit);
        print_per_device(s);
        if (!args.profile_dir.empty()) {
          std::filesystem::create_directories(args.profile_dir);
          const auto path = args.profile_dir + "/" + name + ".trace.json";
          // Host updates the timed steps left running (an overlapped optimizer's) finish before
          // the recording starts; those of the recorded steps finish inside it, before it stops
          // (a host worker records into it while a recorded step's update runs).
          strategy->finish_step();
          bench::TraceRecorder recorder(dev.is_cuda());
          // One forward+backward, or profile_steps whole steps.
          for (int k = 0; k < std::max(1, args.profile_steps); ++k) {
            {
              RECORD_USER_SCOPE("strata::forward_backward");
              strategy->train_step(batch);
              strategy->finish_backward();
            }
            if (args.profile_steps > 0) {
              RECORD_USER_SCOPE("strata::optimizer_step");
              strategy->optimizer_step();
            }
          }
          strategy->finish_step();
          device::synchronize_all();
          recorder.save(path);
          if (args.profile_steps == 0) strategy->optimizer_step();
          std::printf("%-22s profiled %s: %s\n", label.c_str(),
                      args.profile_steps == 0 ? "forward+backward" : (std::to_string(args.profile_steps) + " steps").c_str(),
                      path.c_str());
        }
      }
    } catch (const std::exception& e) {
      // Parity held; the timed run did not. Out of memory is a result; anything else an error.
      const std::string what = e.what();
      const bool oom = bench::is_oom(what);
      std::printf("%-22s %-6s %s%s\n", label.c_str(), "ok", oom ? "out of memory: " : "ERROR: ",
                  what.substr(0, 300).c_str());
      if (!oom) ++failed;
    }
    std::fflush(stdout);
  }
  if (failed > 0) std::printf("%d of %zu strategies failed parity or errored\n", failed, args.strategies.size());
  return failed > 0 ? 1 : 0;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) { return strata::bench::tool_main("strata_compare", strata::run, argc, argv); }
