// strata_ab: two configurations timed step by step in turn, in one process. What drifts between
// processes or during a run (a host's memory bandwidth moved by 20% between invocations on the
// H200 hosts; clocks; other tenants) then falls on both arms alike, and the paired differences
// show an effect smaller than that drift. Both arms are built and attached first and stay
// attached (each holds its own model and state), and the order alternates (A B, B A, A B, ...).
//
//   strata_ab --a=STRATEGY[:k=v;k=v] --b=STRATEGY[:k=v;k=v] [--model=PRESET] [--device=cpu|cuda:N]
//             [--steps=N] [--run=K] [--batch=N] [--precision=P] [--optimizer=sgd|adamw] [--no-tf32]
//
// Prints each arm's medians (forward+backward, optimizer step, whole step, host update time where
// the strategy reports it) and, for each, the median of the paired differences B - A with a 95%
// interval that assumes nothing of their distribution (sign-test order statistics; it needs 6
// pairs or more). Exit status: 0 when both arms passed parity and ran; 1 when one failed parity or
// errored; 2 for bad arguments.
//
// A turn ends with Strategy::finish_step, since the next turn belongs to the other arm: a strategy
// that leaves work for its next step (hook_offload_overlap's deferred updates) is timed with that
// work inside its turn. With one step a turn (the default) its "step" is then not its steady-state
// step; --run=K gives each turn K steps in a row, as strata_bench's repetitions do, each turn
// counting as one pair member with its per-step means, and the tail's share falls to 1/K.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "bench/common.h"
#include "models/check.h"
#include "strategies/device/device.h"
#include "strategies/strategy.h"

namespace strata {
namespace {

struct Arm {
  std::string text;  ///< as given: "hook_offload:prefetch=2"
  std::string strategy;
  std::map<std::string, std::string> options;
  std::string label;
};

struct Args {
  Arm a, b;
  std::string model;
  std::string device = device::cuda_available() ? "cuda:0" : "cpu";
  int steps = 20;
  int run = 1;  ///< steps of one arm in a row, per turn
  int64_t batch = 0;
  std::string optimizer = "adamw";
  PrecisionPolicy precision;
  bool tf32 = true;
};

constexpr const char* kUsage =
    "usage: strata_ab --a=STRATEGY[:k=v;k=v] --b=STRATEGY[:k=v;k=v] [--model=PRESET] [--device=cpu|cuda:N]\n"
    "                 [--steps=N] [--run=K] [--batch=N] [--precision=P] [--optimizer=sgd|adamw] [--no-tf32] | --help\n"
    "Times two configurations step by step in turn in one process (A B, B A, ...) and prints each one's\n"
    "medians and the median of the paired differences B - A with a 95% interval.\n"
    "  --a, --b      a registered strategy, with its options after ':' (';'-separated)\n"
    "  --steps       timed pairs, after two warm-up steps of each (default 20; an interval needs 6)\n"
    "  --run         steps of one arm in a row per turn, timed as one (default 1); for a strategy that\n"
    "                defers work into its next step, K > 1 times its steady state (each turn's last\n"
    "                step waits for its own deferred work)\n"
    "  --model       a preset (default gpt-cpu on the CPU, gpt-medium on a GPU)\n"
    "  --precision   as strata_bench's: fp32, bf16, fp16, with overrides (bf16,transfer=fp32)\n";

Arm parse_arm(const char* key, const std::string& text) {
  STRATA_CHECK(!text.empty(), "--" << key << "= names no strategy");
  Arm arm;
  arm.text = text;
  const auto colon = text.find(':');
  arm.strategy = text.substr(0, colon);
  if (colon != std::string::npos) {
    for (const auto& [k, v] : bench::parse_options_arg(text.substr(colon + 1))) {
      STRATA_CHECK(k.find(':') == std::string::npos,
                   "--" << key << "='" << text << "': an option for another strategy ('" << k << "') has no place here");
      arm.options[k] = v;
    }
  }
  Registry::description(arm.strategy);  // an unknown name fails before any work, naming it
  arm.label = bench::label_with_options(arm.strategy, arm.options);
  return arm;
}

Args parse_args(int argc, char** argv) {
  Args a;
  bool have_a = false, have_b = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::printf("%s%s", kUsage, bench::kExitStatuses);
      std::exit(0);
    }
    auto value = [&](const char* key) -> const char* {
      const std::string prefix = std::string("--") + key + "=";
      return arg.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (const char* v = value("a")) a.a = parse_arm("a", v), have_a = true;
    else if (const char* v = value("b")) a.b = parse_arm("b", v), have_b = true;
    else if (const char* v = value("model")) a.model = v;
    else if (const char* v = value("device")) a.device = v;
    else if (const char* v = value("steps")) a.steps = static_cast<int>(bench::int_arg("steps", v));
    else if (const char* v = value("run")) a.run = static_cast<int>(bench::int_arg("run", v));
    else if (const char* v = value("batch")) a.batch = bench::int_arg("batch", v);
    else if (const char* v = value("optimizer")) a.optimizer = v;
    else if (const char* v = value("precision")) a.precision = PrecisionPolicy::parse(v);
    else if (arg == "--no-tf32") a.tf32 = false;
    else STRATA_FAIL("unknown argument '" << arg << "' (strata_ab --help lists the arguments)");
  }
  STRATA_CHECK(have_a && have_b, "both --a=STRATEGY and --b=STRATEGY are needed (strata_ab --help)");
  STRATA_CHECK(a.steps >= 1, "--steps=" << a.steps << " must be at least 1");
  STRATA_CHECK(a.run >= 1, "--run=" << a.run << " must be at least 1");
  return a;
}

/// A 95% interval for the median of `d` from its order statistics (the sign test's): the k-th
/// smallest and k-th largest, k the largest with P(Binomial(n, 1/2) < k) <= 2.5%. None for n < 6.
bool median_interval(std::vector<double> d, double& low, double& high) {
  const int n = static_cast<int>(d.size());
  std::sort(d.begin(), d.end());
  double below = 0;  // P(X < k) for X ~ Binomial(n, 1/2)
  int k = 0;
  for (int j = 0; j < n; ++j) {
    const double p = std::exp(std::lgamma(n + 1.0) - std::lgamma(j + 1.0) - std::lgamma(n - j + 1.0) - n * std::log(2.0));
    if (below + p > 0.025) break;
    below += p;
    k = j + 1;
  }
  if (k < 1) return false;
  low = d[k - 1];
  high = d[n - k];
  return true;
}

struct Times {
  std::vector<double> fwd_bwd, optim, step, host;
};

int run(int argc, char** argv) {
  const auto args = parse_args(argc, argv);
  const auto dev = device::parse(args.device);
  auto preset = models::preset(args.model.empty() ? (dev.is_cuda() ? "gpt-medium" : "gpt-cpu") : args.model);
  const int64_t batch_size = args.batch > 0 ? args.batch : preset.batch_size;
  at::globalContext().setAllowTF32CuBLAS(args.tf32);
  at::globalContext().setAllowTF32CuDNN(args.tf32);
  StrategyConfig config;
  config.device = dev;
  config.optimizer.kind = parse_optimizer_kind(args.optimizer);
  config.optimizer.lr = 1e-4;
  config.precision = args.precision;
  std::printf("strata A/B: model %s (%s), batch %ld, %d pairs in alternating order, %d step%s a turn, %s, precision %s, "
              "device %s\n",
              preset.name.c_str(), preset.config.to_string().c_str(), static_cast<long>(batch_size), args.steps,
              args.run, args.run == 1 ? "" : "s", config.optimizer.to_string().c_str(), args.precision.to_string().c_str(),
              dev.str().c_str());

  const Arm* arms[2] = {&args.a, &args.b};
  std::unique_ptr<Strategy> strategies[2];
  Times times[2];
  bool reports_host[2] = {false, false};
  auto batch = models::make_batch(preset.config, batch_size, 1);
  for (int i = 0; i < 2; ++i) {
    const auto& arm = *arms[i];
    const auto parity = bench::check_before_timing(arm.strategy, preset.config, arm.options, dev, args.precision);
    if (!parity.ok) {
      std::printf("%c %s: parity FAILED: %s\n", 'A' + i, arm.label.c_str(), parity.message.c_str());
      return 1;
    }
  }
  auto now = [] { return std::chrono::steady_clock::now(); };
  auto ms_since = [&](auto start) { return std::chrono::duration<double, std::milli>(now() - start).count(); };
  try {
    for (int i = 0; i < 2; ++i) {
      auto c = config;
      c.options = arms[i]->options;
      strategies[i] = Registry::create(arms[i]->strategy, c);
      strategies[i]->attach(models::build_model(preset.config, 0));
    }
    for (int i = 0; i < 2; ++i) bench::warm_up(*strategies[i], batch);
    for (int pair = 0; pair < args.steps; ++pair) {
      for (int turn = 0; turn < 2; ++turn) {
        const int i = (pair + turn) % 2;  // A B, then B A: neither always runs first
        auto& s = *strategies[i];
        s.reset_stats();
        double fb = 0, opt = 0;  // summed over the turn's steps
        for (int k = 0; k < args.run; ++k) {
          const auto start = now();
          s.train_step(batch);
          s.finish_backward();
          device::synchronize_all();
          fb += ms_since(start);
          const auto mid = now();
          s.optimizer_step();
          if (k + 1 == args.run) s.finish_step();  // the turn's last step: nothing left for the other arm
          device::synchronize_all();
          opt += ms_since(mid);
        }
        const auto stats = s.stats();
        times[i].fwd_bwd.push_back(fb / args.run);
        times[i].optim.push_back(opt / args.run);
        times[i].step.push_back((fb + opt) / args.run);
        times[i].host.push_back(stats.host_update_ms / args.run);
        reports_host[i] = reports_host[i] || stats.host_update_ms > 0;
      }
      if ((pair + 1) % 10 == 0 && pair + 1 < args.steps) {
        std::fprintf(stderr, "strata_ab: %d of %d pairs\n", pair + 1, args.steps);
      }
    }
  } catch (const std::exception& e) {
    std::printf("ERROR (out of memory is one, with both arms attached at once): %s\n",
                bench::for_the_user(e.what()).c_str());
    return 1;
  }

  std::printf("%-3s %-40s %12s %12s %12s %14s\n", "arm", "strategy", "fwd+bwd ms", "optim ms", "step ms", "host update ms");
  for (int i = 0; i < 2; ++i) {
    char host[32] = "-";
    if (reports_host[i]) std::snprintf(host, sizeof host, "%.2f", bench::median(times[i].host));
    std::printf("%-3c %-40s %12.2f %12.2f %12.2f %14s\n", 'A' + i, arms[i]->label.c_str(), bench::median(times[i].fwd_bwd),
                bench::median(times[i].optim), bench::median(times[i].step), host);
  }
  auto difference = [&](const char* what, const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> d(a.size());
    for (size_t k = 0; k < a.size(); ++k) d[k] = b[k] - a[k];
    double low = 0, high = 0;
    std::printf("B - A %-16s median %+9.2f ms", what, bench::median(d));
    if (median_interval(d, low, high))
      std::printf(", 95%% interval [%+.2f, %+.2f]%s\n", low, high, low > 0 || high < 0 ? " (B differs)" : "");
    else
      std::printf(" (%zu pairs: too few for a 95%% interval, 6 needed)\n", d.size());
  };
  difference("fwd+bwd", times[0].fwd_bwd, times[1].fwd_bwd);
  difference("optim", times[0].optim, times[1].optim);
  difference("step", times[0].step, times[1].step);
  if (reports_host[0] && reports_host[1]) difference("host update", times[0].host, times[1].host);
  return 0;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) { return strata::bench::tool_main("strata_ab", strata::run, argc, argv); }
