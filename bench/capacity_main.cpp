// strata_capacity: the largest model each strategy trains on this machine, measured by bisection
// and predicted by bench/memory_model.h, or (--fit) which strategies train one given model here.
//
//   strata_capacity [--device=cuda:0] [--model=gpt-871m] [--scale=depth|width|classes]
//                   [--strategies=a,b] [--min=N] [--max=N] [--resolution=N] [--batch=N]
//                   [--precision=fp32] [--optimizer=adamw] [--steps=2] [--options='k=v;strategy:k=v']
//                   [--device-memory=GiB] [--host-memory=GiB] [--timeout=S] [--json=FILE]
//   strata_capacity --fit=PRESET [--size=N --scale=AXIS] [same options]
//
// Each probe (a size of the axis, for one strategy) runs in a process of its own: the strategy
// is parity-checked on the tiny model of the same kind first (once per strategy, here), then the
// probe builds the model at that size, trains one warm-up step and --steps timed ones (forward,
// backward, optimizer), and reports its step time and peaks. A device out-of-memory, or a host
// one (the allocator's error, the --host-memory cap, or the process killed by SIGKILL, which the
// kernel's out-of-memory killer sends), is the answer "does not fit"; anything else is an error
// that ends that strategy's search. --device-memory caps the CUDA caching allocator (its memory
// fraction) to emulate a smaller card (the CUDA context and libraries' workspaces sit outside that
// cap, so a real card of that size holds a little less); --host-memory caps what a probe's process
// may add to its resident memory after start-up (LibTorch and CUDA loaded), which includes building
// the model on the host (4 bytes a parameter) for every strategy. The parity check runs in a child
// process too, so this one holds no device memory while probes run.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "bench/capacity.h"
#include "bench/common.h"
#include "bench/memory_model.h"
#include "strategies/optim.h"

namespace strata {
namespace {

using bench::json_string;

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr const char* kProbeTag = "strata_capacity probe: ";

struct Args {
  std::string device, model = "gpt-871m", scale = "depth", fit, json, options_text, optimizer = "adamw";
  std::vector<std::string> strategies;
  int64_t min = 0, max = 0, resolution = 0, batch = 0, size = 0, steps = 2, timeout_s = 900;
  double device_memory_gib = 0, host_memory_gib = 0;
  PrecisionPolicy precision;
  std::string precision_text = "fp32";
  std::map<std::string, std::string> options;
  // A probe's own (the parent passes them).
  bool probe = false, parity = false, predict_only = false;
  std::string strategy, config;
};

const char* kUsage =
    "usage: strata_capacity [--device=cuda:0] [--model=PRESET] [--scale=depth|width|classes]\n"
    "                       [--strategies=a,b] [--min=N] [--max=N] [--resolution=N] [--batch=N]\n"
    "                       [--precision=fp32|bf16|fp16] [--optimizer=adamw|sgd] [--steps=N]\n"
    "                       [--options='k=v;strategy:k=v'] [--device-memory=GiB] [--host-memory=GiB]\n"
    "                       [--timeout=S] [--json=FILE]\n"
    "       strata_capacity --fit=PRESET [--scale=AXIS --size=N] [the same options]\n"
    "       strata_capacity --predict [--size=N] [the same options]\n"
    "  --scale         the axis searched: depth (layers), width (a multiple of heads x 8), classes (bert)\n"
    "  --min, --max    the sizes searched (default: the axis' step; twice the memory model's largest, or\n"
    "                  four times the preset's size where the strategy is not modelled)\n"
    "  --resolution    stop when the largest that trains and the smallest that does not are this close\n"
    "  --steps         timed training steps per probe, after one warm-up step\n"
    "  --device-memory emulate a card of this many GiB: the CUDA caching allocator's cap (the CUDA\n"
    "                  context and libraries' workspaces sit outside it, so a real card that size holds less)\n"
    "  --host-memory   cap what a probe may add to its host memory, in GiB\n"
    "  --timeout       seconds a probe may run before it is stopped (an error)\n"
    "  --fit           which strategies train this preset here, fastest first\n"
    "  --predict       the memory model's answer alone (no probe, no parity check): each strategy's\n"
    "                  predicted largest size, and its bytes at --size (default: the preset's);\n"
    "                  with --device-memory it needs no GPU here (a plan for another machine)\n"
    "exit status: 0 every search ran (out of memory is an answer); 1 a strategy failed parity or a\n"
    "probe errored; 2 a bad argument (named on stderr)\n";

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&](const char* key) -> const char* {
      const std::string prefix = std::string("--") + key + "=";
      return arg.rfind(prefix, 0) == 0 ? argv[i] + prefix.size() : nullptr;
    };
    if (arg == "--help" || arg == "-h") {
      std::printf("%s", kUsage);
      std::exit(0);
    } else if (arg == "--probe") {
      a.probe = true;
    } else if (arg == "--parity") {
      a.parity = true;
    } else if (arg == "--predict") {
      a.predict_only = true;
    } else if (const char* v = value("device")) {
      a.device = v;
    } else if (const char* v = value("model")) {
      a.model = v;
    } else if (const char* v = value("scale")) {
      a.scale = v;
    } else if (const char* v = value("fit")) {
      a.fit = v;
    } else if (const char* v = value("json")) {
      a.json = v;
    } else if (const char* v = value("strategies")) {
      a.strategies = split(v, ',');
    } else if (const char* v = value("options")) {
      a.options_text = v;
      a.options = bench::parse_options_arg(v);
    } else if (const char* v = value("optimizer")) {
      a.optimizer = v;
      parse_optimizer_kind(a.optimizer);
    } else if (const char* v = value("precision")) {
      a.precision_text = v;
      a.precision = PrecisionPolicy::parse(v);
    } else if (const char* v = value("min")) {
      a.min = bench::int_arg("min", v);
      STRATA_CHECK(a.min >= 1, "--min=" << a.min << " must be at least 1");
    } else if (const char* v = value("max")) {
      a.max = bench::int_arg("max", v);
      STRATA_CHECK(a.max >= 1, "--max=" << a.max << " must be at least 1");
    } else if (const char* v = value("resolution")) {
      a.resolution = bench::int_arg("resolution", v);
      STRATA_CHECK(a.resolution >= 1, "--resolution=" << a.resolution << " must be at least 1");
    } else if (const char* v = value("batch")) {
      a.batch = bench::int_arg("batch", v);
      STRATA_CHECK(a.batch >= 1, "--batch=" << a.batch << " must be at least 1");
    } else if (const char* v = value("size")) {
      a.size = bench::int_arg("size", v);
      STRATA_CHECK(a.size >= 1, "--size=" << a.size << " must be at least 1");
    } else if (const char* v = value("steps")) {
      a.steps = bench::int_arg("steps", v);
      STRATA_CHECK(a.steps >= 1 && a.steps <= 100, "--steps=" << a.steps << " must be 1 to 100");
    } else if (const char* v = value("timeout")) {
      a.timeout_s = bench::int_arg("timeout", v);
      STRATA_CHECK(a.timeout_s >= 1, "--timeout=" << a.timeout_s << " must be at least 1 second");
    } else if (const char* v = value("device-memory")) {
      a.device_memory_gib = bench::real_arg("device-memory", v);
      STRATA_CHECK(a.device_memory_gib > 0, "--device-memory=" << v << " must be above 0 GiB");
    } else if (const char* v = value("host-memory")) {
      a.host_memory_gib = bench::real_arg("host-memory", v);
      STRATA_CHECK(a.host_memory_gib > 0, "--host-memory=" << v << " must be above 0 GiB");
    } else if (const char* v = value("strategy")) {
      a.strategy = v;
    } else if (const char* v = value("config")) {
      a.config = v;
    } else {
      STRATA_FAIL("unknown argument '" << arg << "' (strata_capacity --help lists the arguments)");
    }
  }
  if (a.device.empty()) a.device = torch::cuda::is_available() ? "cuda:0" : "cpu";
  STRATA_CHECK(a.size == 0 || !a.fit.empty() || a.predict_only,
               "--size=" << a.size << " is for --fit and --predict (the search picks its own sizes)");
  return a;
}

// A "Field:   N kB" line of a /proc file, in bytes (0 if absent).
int64_t proc_kb_field(const char* path, const char* field) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::strlen(field))) * 1024;
  return 0;
}
int64_t rss_bytes() { return proc_kb_field("/proc/self/status", "VmRSS:"); }
int64_t peak_rss_bytes() { return proc_kb_field("/proc/self/status", "VmHWM:"); }

// Which memory ran out, from the error's text: the CUDA caching allocator's own message names the
// device; a failed pinned (cudaHostAlloc) or ordinary host allocation is the host's.
bench::ProbeOutcome classify(const std::string& what) {
  if (what.find("CUDA out of memory") != std::string::npos) return bench::ProbeOutcome::device_oom;
  if (bench::is_oom(what) || what.find("bad_alloc") != std::string::npos) return bench::ProbeOutcome::host_oom;
  return bench::ProbeOutcome::error;
}

std::string probe_line(const bench::Probe& p) {
  std::ostringstream out;
  out << kProbeTag << "outcome=" << static_cast<int>(p.outcome) << " step_ms=" << p.step_ms
      << " parameters=" << p.parameters << " peak_device=" << p.peak_device << " peak_host=" << p.peak_host
      << " message=" << p.message;
  std::string s = out.str();
  for (auto& ch : s)
    if (ch == '\n') ch = ' ';
  return s + "\n";
}

bench::Probe parse_probe_line(const std::string& line) {
  bench::Probe p;
  std::istringstream in(line.substr(std::strlen(kProbeTag)));
  std::string item;
  while (in >> item) {
    const auto eq = item.find('=');
    const auto key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "message") {
      std::string rest;
      std::getline(in, rest);
      p.message = value + rest;
      break;
    }
    if (key == "outcome") p.outcome = static_cast<bench::ProbeOutcome>(std::stoi(value));
    if (key == "step_ms") p.step_ms = std::stod(value);
    if (key == "parameters") p.parameters = std::stoll(value);
    if (key == "peak_device") p.peak_device = std::stoll(value);
    if (key == "peak_host") p.peak_host = std::stoll(value);
  }
  return p;
}

// The probe itself, in its own process: one model size, one strategy.
int run_probe(const Args& a) {
  const auto dev = device::parse(a.device);
  if (a.device_memory_gib > 0) device::limit_memory(dev, static_cast<int64_t>(a.device_memory_gib * kGiB));
  // The host's start line: LibTorch and, on a GPU, the CUDA context loaded.
  if (dev.is_cuda()) device::allocator_stats(dev);
  const int64_t base = rss_bytes();
  const auto cap = static_cast<int64_t>(a.host_memory_gib * kGiB);
  if (a.host_memory_gib > 0) {
    std::thread([base, cap] {
      for (;;) {
        const auto grown = rss_bytes() - base;
        if (grown > cap) {
          bench::Probe p;
          p.outcome = bench::ProbeOutcome::host_oom;
          p.peak_host = grown;
          p.message = "the host memory cap (--host-memory) was passed: " + std::to_string(grown) + " bytes above start";
          const auto line = probe_line(p);
          (void)!write(STDOUT_FILENO, line.data(), line.size());
          _exit(3);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
    }).detach();
  }
  at::globalContext().setAllowTF32CuBLAS(true);
  at::globalContext().setAllowTF32CuDNN(true);
  bench::Probe p;
  try {
    const auto config = models::ModelConfig::parse(a.config);
    StrategyConfig sc;
    sc.device = dev;
    sc.optimizer.kind = parse_optimizer_kind(a.optimizer);
    sc.optimizer.lr = 1e-4;
    sc.precision = a.precision;
    sc.options = bench::options_for(a.options, a.strategy);
    auto strategy = Registry::create(a.strategy, sc);
    auto model = models::build_model(config, 0);
    p.parameters = model.parameter_count();
    strategy->attach(std::move(model));
    const auto batch = models::make_batch(config, a.batch, 1);
    std::vector<double> ms;
    for (int64_t i = 0; i <= a.steps; ++i) {  // the first is the warm-up
      const auto t0 = std::chrono::steady_clock::now();
      strategy->train_step(batch);
      strategy->optimizer_step();
      strategy->finish_step();
      device::synchronize_all();
      if (i > 0) ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    p.step_ms = bench::median(ms);
    p.peak_device = bench::peaks_of(strategy->stats()).allocated;
    p.outcome = bench::ProbeOutcome::trains;
  } catch (const std::bad_alloc&) {
    p.message = "std::bad_alloc: a host allocation failed";
    p.outcome = bench::ProbeOutcome::host_oom;
  } catch (const std::exception& e) {
    p.message = bench::for_the_user(e.what());
    p.outcome = classify(p.message);
    if (dev.is_cuda()) p.peak_device = device::allocator_stats(dev).peak_allocated;
    if (p.message.size() > 300) p.message = p.message.substr(0, 300) + "...";
  }
  p.peak_host = peak_rss_bytes() - base;
  if (a.host_memory_gib > 0 && p.peak_host > cap && fits(p.outcome)) {  // a peak between the watchdog's looks
    p.outcome = bench::ProbeOutcome::host_oom;
    p.message = "the host memory cap (--host-memory) was passed: " + std::to_string(p.peak_host) + " bytes above start";
  }
  const auto line = probe_line(p);
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);
  return 0;
}

// This binary again in a child process, its stdout and stderr read until it ends or `timeout_s`
// passes (then it is killed).
struct Child {
  std::string output;
  int status = 0;
  bool timed_out = false;
};
Child run_child(std::vector<std::string> args, int64_t timeout_s) {
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  int fds[2];
  STRATA_CHECK(pipe2(fds, O_CLOEXEC) == 0, "strata_capacity: no pipe for a probe");
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    STRATA_FAIL("strata_capacity: could not start a probe");
  }
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    // Were the host to run out, the kernel's killer should pick the probe, not this process.
    if (FILE* f = std::fopen("/proc/self/oom_score_adj", "w")) std::fputs("500", f), std::fclose(f);
    execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  close(fds[1]);
  Child c;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  for (;;) {
    pollfd pfd{fds[0], POLLIN, 0};
    const int ready = poll(&pfd, 1, 200);
    if (ready > 0) {
      char buf[4096];
      const auto n = read(fds[0], buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      c.output.append(buf, static_cast<size_t>(n));
    }
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      c.timed_out = true;
      break;
    }
  }
  close(fds[0]);
  while (waitpid(pid, &c.status, 0) < 0 && errno == EINTR) {
  }
  return c;
}

std::string how_it_ended(int status) {
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "exit status " + std::to_string(WEXITSTATUS(status));
}

std::string tail_of(const std::string& output) {
  auto tail = output.size() > 400 ? output.substr(output.size() - 400) : output;
  for (auto& ch : tail)
    if (ch == '\n') ch = ' ';
  return tail;
}

std::vector<std::string> child_args(const Args& a, const char* mode, const std::string& strategy,
                                    const models::ModelConfig& config, int64_t batch) {
  std::vector<std::string> args = {"strata_capacity", mode, "--strategy=" + strategy,
                                   "--config=" + config.to_string(), "--device=" + a.device,
                                   "--batch=" + std::to_string(batch), "--precision=" + a.precision_text,
                                   "--optimizer=" + a.optimizer, "--steps=" + std::to_string(a.steps)};
  if (!a.options_text.empty()) args.push_back("--options=" + a.options_text);
  if (a.device_memory_gib > 0) args.push_back("--device-memory=" + std::to_string(a.device_memory_gib));
  if (a.host_memory_gib > 0) args.push_back("--host-memory=" + std::to_string(a.host_memory_gib));
  return args;
}

// One probe in a child process (this binary with --probe); its last lines on a failure.
bench::Probe spawn_probe(const Args& a, const std::string& strategy, const models::ModelConfig& config,
                         int64_t batch) {
  const auto c = run_child(child_args(a, "--probe", strategy, config, batch), a.timeout_s);
  bench::Probe p;
  const auto tag = c.output.rfind(kProbeTag);
  if (c.timed_out) {
    p.outcome = bench::ProbeOutcome::error;
    p.message = "timed out after " + std::to_string(a.timeout_s) + " s (--timeout)";
  } else if (tag != std::string::npos) {
    const auto end = c.output.find('\n', tag);
    p = parse_probe_line(c.output.substr(tag, end == std::string::npos ? std::string::npos : end - tag));
  } else if (WIFSIGNALED(c.status) && WTERMSIG(c.status) == SIGKILL) {
    p.outcome = bench::ProbeOutcome::host_oom;
    p.message = "killed by SIGKILL (the kernel's out-of-memory killer, most likely)";
  } else {
    p.outcome = bench::ProbeOutcome::error;
    p.message = "the probe ended without a result (" + how_it_ended(c.status) + "): " + tail_of(c.output);
  }
  return p;
}

// The parity check on the tiny model of the same kind, in a child process too: the parent holds
// no device memory (no CUDA context) while probes run.
constexpr const char* kParityTag = "strata_capacity parity: ";
correctness::ParityResult spawn_parity(const Args& a, const std::string& strategy, const models::ModelConfig& config) {
  const auto c = run_child(child_args(a, "--parity", strategy, config, 1), std::max<int64_t>(a.timeout_s, 600));
  const auto tag = c.output.rfind(kParityTag);
  if (tag == std::string::npos)
    return {false, "the check ended without a result (" + how_it_ended(c.status) + "): " + tail_of(c.output)};
  const auto end = c.output.find('\n', tag);
  const auto verdict = c.output.substr(tag + std::strlen(kParityTag),
                                       end == std::string::npos ? std::string::npos : end - tag - std::strlen(kParityTag));
  if (verdict == "ok") return {true, ""};
  return {false, verdict};
}

int run_parity(const Args& a) {
  const auto dev = device::parse(a.device);
  const auto config = models::ModelConfig::parse(a.config);
  correctness::ParityResult r;
  try {
    r = bench::check_before_timing(a.strategy, config, bench::options_for(a.options, a.strategy), dev, a.precision);
  } catch (const std::exception& e) {
    r = {false, std::string("the check could not run: ") + bench::for_the_user(e.what())};
  }
  std::string line = kParityTag + (r.ok ? std::string("ok") : r.message);
  for (auto& ch : line)
    if (ch == '\n') ch = ' ';
  std::printf("%s\n", line.c_str());
  return 0;
}

std::string probe_json(const std::string& strategy, const bench::Probe& p, const bench::MemoryPrediction* predicted) {
  std::ostringstream out;
  out << "{\"strategy\": " << json_string(strategy) << ", \"size\": " << p.size << ", \"outcome\": "
      << json_string(bench::to_string(p.outcome)) << ", \"parameters\": " << p.parameters
      << ", \"step_ms\": " << (std::isfinite(p.step_ms) ? p.step_ms : 0.0) << ", \"peak_device_bytes\": " << p.peak_device
      << ", \"peak_host_bytes\": " << p.peak_host << ", \"probe_seconds\": " << p.seconds;
  if (predicted)
    out << ", \"predicted_device_bytes\": " << predicted->device_bytes()
        << ", \"predicted_host_bytes\": " << predicted->host_bytes();
  out << ", \"message\": " << json_string(p.message) << "}";
  return out.str();
}

int run(int argc, char** argv) {
  const auto a = parse_args(argc, argv);
  if (a.probe) return run_probe(a);
  if (a.parity) return run_parity(a);
  // --predict for a card given by --device-memory needs no card: a plan made on another machine.
  const auto dev = a.predict_only && a.device_memory_gib > 0 ? device::parse_name(a.device) : device::parse(a.device);
  const auto preset = models::preset(a.fit.empty() ? a.model : a.fit);
  const auto axis = bench::axis_for(a.scale, preset.config);
  const int64_t batch = a.batch > 0 ? a.batch : preset.batch_size;
  const auto strategies = a.strategies.empty()
                              ? std::vector<std::string>{"baseline", "baseline_checkpoint", "hook_offload",
                                                         "hook_offload_overlap", "sharded", "sharded_offload"}
                              : a.strategies;
  for (const auto& s : strategies) Registry::description(s);  // unknown names fail before any work
  STRATA_CHECK(a.device_memory_gib == 0 || dev.is_cuda(),
               "--device-memory emulates a smaller GPU; on " << dev << " the host's memory is the device's (--host-memory)");
  if (a.device_memory_gib > 0 && !a.predict_only)
    STRATA_CHECK(a.device_memory_gib * kGiB <= static_cast<double>(device::total_memory(dev)),
                 "--device-memory=" << a.device_memory_gib << " is more than " << dev << "'s "
                                    << device::total_memory(dev) / kGiB << " GiB");
  // What a probe may hold: the emulated card, else the whole one; the host's cap, else what is free.
  const int64_t host_limit = a.host_memory_gib > 0 ? static_cast<int64_t>(a.host_memory_gib * kGiB)
                                                   : proc_kb_field("/proc/meminfo", "MemAvailable:");
  const int64_t device_limit = !dev.is_cuda()                ? host_limit
                               : a.device_memory_gib > 0 ? static_cast<int64_t>(a.device_memory_gib * kGiB)
                                                          : device::total_memory(dev);
  std::printf("strata capacity: %s along %s, batch %ld, precision %s, %s; device %s with %.1f GiB%s, host %.1f GiB%s\n",
              preset.name.c_str(), axis.name.c_str(), static_cast<long>(batch), a.precision.to_string().c_str(),
              a.optimizer.c_str(), dev.str().c_str(), device_limit / kGiB, a.device_memory_gib > 0 ? " (emulated)" : "",
              host_limit / kGiB, a.host_memory_gib > 0 ? " (capped)" : " (available)");
  std::fflush(stdout);

  // The memory model's answer, or none (with why) for a strategy or setting it does not model.
  std::string unmodelled;
  auto predict = [&](const std::string& strategy, const models::ModelConfig& config) -> std::optional<bench::MemoryPrediction> {
    bench::MemoryQuestion q{strategy, bench::options_for(a.options, strategy), config, batch, a.precision, {}};
    q.optimizer.kind = parse_optimizer_kind(a.optimizer);
    try {
      return bench::predict_memory(q);
    } catch (const Error& e) {
      unmodelled = bench::for_the_user(e.what());
      return std::nullopt;
    }
  };
  auto predicted_fits = [&](const bench::MemoryPrediction& m) {
    return dev.is_cuda() ? m.device_bytes() <= device_limit && m.host_bytes() <= host_limit
                         : m.device_bytes() + m.host_bytes() <= host_limit;
  };
  // The memory model's largest size (a multiple of the axis' step) from `lo_k` steps up, or -1.
  auto predicted_largest = [&](const std::string& strategy, int64_t lo_k) -> int64_t {
    if (!predict(strategy, preset.config)) return -1;
    auto fits_at = [&](int64_t k) { return predicted_fits(*predict(strategy, axis.at(preset.config, k * axis.unit))); };
    if (!fits_at(lo_k)) return -1;
    // Doubled until it does not fit (no card holds 2^40 of anything), then bisected.
    int64_t hi_k = 2 * lo_k;
    while (fits_at(hi_k) && hi_k < (int64_t{1} << 40) / axis.unit) hi_k *= 2;
    const auto f = bench::bisect(lo_k, hi_k, 1, [&](int64_t k) {
      bench::Probe p;
      p.outcome = fits_at(k) ? bench::ProbeOutcome::trains : bench::ProbeOutcome::device_oom;
      return p;
    });
    return f.largest > 0 ? f.largest * axis.unit : -1;
  };

  std::vector<std::string> rows, probes;
  std::vector<std::pair<std::string, bench::Probe>> fitted;  // --fit: each strategy's one probe
  int failed = 0;
  // The JSON, rewritten after each strategy: a run cut short keeps what it found.
  auto write_json = [&] {
    if (a.json.empty()) return;
    const auto partial = a.json + ".partial";  // renamed over the last whole file once written
    std::ofstream out(partial);
    STRATA_CHECK(out, "--json=" << a.json << ": cannot write " << partial);
    out << "{\n\"context\": {\"strata_device\": " << json_string(dev.str())
        << ", \"device_name\": " << json_string(dev.is_cuda() ? device::name(dev) : "cpu")
        << ", \"device_memory_bytes\": " << device_limit << ", \"device_memory_emulated\": " << (a.device_memory_gib > 0 ? "true" : "false")
        << ", \"host_memory_bytes\": " << host_limit << ", \"host_memory_capped\": " << (a.host_memory_gib > 0 ? "true" : "false")
        << ", \"model\": " << json_string(preset.name) << ", \"model_config\": " << json_string(preset.config.to_string())
        << ", \"axis\": " << json_string(axis.name) << ", \"mode\": " << json_string(a.fit.empty() ? "search" : "fit")
        << ", \"batch\": " << batch << ", \"precision\": " << json_string(a.precision.to_string())
        << ", \"optimizer\": " << json_string(a.optimizer) << ", \"steps\": " << a.steps << "},\n\"benchmarks\": [\n";
    for (size_t i = 0; i < rows.size(); ++i) out << "  " << rows[i] << (i + 1 < rows.size() ? ",\n" : "\n");
    out << "],\n\"probes\": [\n";
    for (size_t i = 0; i < probes.size(); ++i) out << "  " << probes[i] << (i + 1 < probes.size() ? ",\n" : "\n");
    out << "]\n}\n";
    out.close();
    STRATA_CHECK(out && std::rename(partial.c_str(), a.json.c_str()) == 0, "--json=" << a.json << ": cannot write it");
  };
  if (a.predict_only) {
    const int64_t size = a.size > 0 ? a.size : axis.of(preset.config);
    for (const auto& strategy : strategies) {
      const auto m = predict(strategy, axis.at(preset.config, size));
      if (!m) {
        std::printf("[%s] not modelled: %s\n", strategy.c_str(), unmodelled.c_str());
        continue;
      }
      std::printf("[%s] %s=%ld: %s; predicted largest %s=%ld\n", strategy.c_str(), axis.name.c_str(),
                  static_cast<long>(size), m->summary().c_str(), axis.name.c_str(),
                  static_cast<long>(predicted_largest(strategy, axis.smallest)));
    }
    return 0;
  }
  write_json();  // the context at once
  for (const auto& strategy : strategies) {
    const auto parity = spawn_parity(a, strategy, preset.config);
    if (!parity.ok) {
      std::printf("[%s] parity failed on the tiny model: %s\n", strategy.c_str(), parity.message.c_str());
      bench::Probe none;
      none.message = "parity failed: " + parity.message;
      fitted.emplace_back(strategy, none);
      rows.push_back("{\"name\": " + json_string("capacity/" + strategy) + ", \"error_message\": " +
                     json_string("parity failed: " + parity.message) + "}");
      ++failed;
      write_json();
      continue;
    }
    auto probe_at = [&](int64_t size) {
      const auto config = axis.at(preset.config, size);
      const auto m = predict(strategy, config);
      std::printf("[%s] %s=%ld (%.3fB parameters%s) ...", strategy.c_str(), axis.name.c_str(), static_cast<long>(size),
                  models::parameter_count(config) / 1e9,
                  m ? (", predicted " + m->summary()).c_str() : "");
      std::fflush(stdout);
      const auto started = std::chrono::steady_clock::now();
      auto p = spawn_probe(a, strategy, config, batch);
      p.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      p.size = size;
      if (fits(p.outcome))
        std::printf(" trains: %.1f ms a step, peak %.2f GiB device, %.2f GiB host (probe %.0f s)\n", p.step_ms,
                    p.peak_device / kGiB, p.peak_host / kGiB, p.seconds);
      else
        std::printf(" %s: %s (probe %.0f s)\n", bench::to_string(p.outcome), p.message.c_str(), p.seconds);
      std::fflush(stdout);
      probes.push_back(probe_json(strategy, p, m ? &*m : nullptr));
      write_json();  // every probe kept as it ends
      return p;
    };

    if (!a.fit.empty()) {  // one model: does it train here, and how fast
      const int64_t size = a.size > 0 ? a.size : axis.of(preset.config);
      const auto p = probe_at(size);
      if (p.outcome == bench::ProbeOutcome::error) ++failed;
      fitted.emplace_back(strategy, p);
      std::ostringstream row;
      row << "{\"name\": " << json_string("fit/" + strategy + "/" + preset.name) << ", \"strategy\": "
          << json_string(strategy) << ", \"outcome\": " << json_string(bench::to_string(p.outcome))
          << ", \"parameters\": " << p.parameters << ", \"step_ms\": " << p.step_ms
          << ", \"peak_device_bytes\": " << p.peak_device << ", \"peak_host_bytes\": " << p.peak_host
          << ", \"message\": " << json_string(p.message) << "}";
      rows.push_back(row.str());
      write_json();
      continue;
    }

    // The predicted frontier first (no process: the memory model alone); the search starts from it.
    // Sizes are multiples of the axis' step: --min rounds up to one, --max down.
    const int64_t lo_k = std::max<int64_t>(axis.smallest, ((a.min > 0 ? a.min : axis.unit) + axis.unit - 1) / axis.unit);
    const int64_t predicted = predicted_largest(strategy, lo_k);
    const int64_t predicted_k = predicted > 0 ? predicted / axis.unit : -1;
    int64_t hi_k = a.max > 0 ? a.max / axis.unit
                   : predicted_k > 0 ? 2 * predicted_k
                                     : 4 * axis.of(preset.config) / axis.unit;
    STRATA_CHECK(hi_k >= lo_k, "--min=" << a.min << " and --max=" << a.max << " leave no " << axis.name
                                       << " to search (sizes are multiples of " << axis.unit << ")");
    const int64_t resolution = a.resolution > 0 ? std::max<int64_t>(1, a.resolution / axis.unit)
                               : axis.name == "classes" ? std::max<int64_t>(1, (hi_k - lo_k) / 128)
                                                        : 1;
    // From the memory model's answer where there is one: a right guess costs two probes.
    auto probe_k = [&](int64_t k) { return probe_at(k * axis.unit); };
    const auto f = predicted_k > 0 ? bench::bisect_from(predicted_k, lo_k, hi_k, resolution, probe_k)
                                   : bench::bisect(lo_k, hi_k, resolution, probe_k);
    // The search's own words count in multiples of the step; an error is told at its real size.
    std::string stopped;
    if (!f.stopped.empty()) {
      ++failed;
      const auto& last = f.probes.back();
      stopped = axis.name + "=" + std::to_string(last.size * axis.unit) + ": " + last.message;
    }
    const bool upper_end = f.largest == hi_k;
    std::ostringstream row;
    row << "{\"name\": " << json_string("capacity/" + strategy + "/" + preset.name + "/" + axis.name)
        << ", \"strategy\": " << json_string(strategy) << ", \"axis\": " << json_string(axis.name);
    // The search ran over multiples of the axis' step: its sizes are those multiples.
    const auto* best = f.largest > 0 ? f.at(f.largest) : nullptr;
    const auto* next = f.failing > 0 ? f.at(f.failing) : nullptr;
    const int64_t best_size = best ? f.largest * axis.unit : -1, next_size = next ? f.failing * axis.unit : -1;
    row << ", \"largest\": " << best_size;
    if (best)
      row << ", \"parameters\": " << best->parameters << ", \"step_ms\": " << best->step_ms
          << ", \"peak_device_bytes\": " << best->peak_device << ", \"peak_host_bytes\": " << best->peak_host;
    if (best) {
      if (const auto m = predict(strategy, axis.at(preset.config, best_size)))
        row << ", \"predicted_device_bytes\": " << m->device_bytes() << ", \"predicted_host_bytes\": " << m->host_bytes();
    }
    row << ", \"next\": " << next_size << ", \"next_outcome\": "
        << json_string(next ? bench::to_string(next->outcome) : upper_end ? "the upper end trains" : "");
    row << ", \"predicted_largest\": " << (predicted_k > 0 ? predicted_k * axis.unit : -1);
    if (!stopped.empty()) row << ", \"error_message\": " << json_string("error: " + stopped);
    row << "}";
    rows.push_back(row.str());
    write_json();
    std::printf("[%s] largest that trains: %s=%ld%s (predicted %ld)%s\n", strategy.c_str(), axis.name.c_str(),
                static_cast<long>(best_size),
                next ? (", next " + std::to_string(next_size) + ": " + bench::to_string(next->outcome)).c_str()
                     : upper_end ? " (the upper end: raise --max)" : "",
                static_cast<long>(predicted_k > 0 ? predicted_k * axis.unit : -1),
                stopped.empty() ? "" : ("; stopped: " + stopped).c_str());
    std::fflush(stdout);
  }

  if (!a.fit.empty()) {
    bench::order_by_fit(fitted);
    std::printf("%s on %s: what trains, fastest first\n", preset.name.c_str(), dev.str().c_str());
    for (const auto& [strategy, p] : fitted) {
      if (fits(p.outcome))
        std::printf("  %-22s %10.1f ms a step, peak %.2f GiB device, %.2f GiB host\n", strategy.c_str(), p.step_ms,
                    p.peak_device / kGiB, p.peak_host / kGiB);
      else
        std::printf("  %-22s %s\n", strategy.c_str(),
                    p.outcome == bench::ProbeOutcome::error ? p.message.c_str() : bench::to_string(p.outcome));
    }
  }
  return failed > 0 ? 1 : 0;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) { return strata::bench::tool_main("strata_capacity", strata::run, argc, argv); }
