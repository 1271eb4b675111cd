#pragma once
// The one interface every training strategy sits behind. Tests and benchmarks see nothing else.
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/model.h"
#include "strategies/training_state.h"
#include "strategies/optim.h"
#include "strategies/precision.h"

namespace strata {
namespace distributed {
class Group;
}

/// Host tensors by canonical name, in canonical order; tied parameters appear once.

/// Memory of one device, in bytes.
struct DeviceMemory {
  int64_t resident_param_bytes = 0;  ///< parameter bytes on the device now (strategy accounting)
  int64_t peak_param_bytes = 0;      ///< most parameter bytes on it at once since reset_stats()
  int64_t peak_allocated = 0;        ///< CUDA caching allocator peak since reset_stats(); 0 on CPU
  int64_t peak_reserved = 0;
};

/// What a strategy moved and held since the last reset_stats().
struct Stats {
  int64_t bytes_h2d = 0;           ///< host to device
  int64_t bytes_d2h = 0;           ///< device to host
  int64_t bytes_interconnect = 0;  ///< device to device and collectives
  double loss_scale = 1.0;         ///< fp16: the loss scale now (1 when the policy does not scale)
  int64_t skipped_steps = 0;       ///< fp16: optimizer steps skipped for an inf or nan gradient, ever
  /// Fetches to a device queued behind a host optimizer update that had not run yet (updates
  /// deferred into the next step): the device work of such a step waits for the host.
  int64_t fetches_behind_host_updates = 0;
  /// Wall time the host spent applying the step's gradients, for strategies that step on the host:
  /// the optimizer pass, and the host work it needs first (an accumulated gradient's sum,
  /// fp16's unscaling), counted from the moment the gradients had landed. Set against the step
  /// time, how busy the host optimizer was (and, against its bytes, at what rate).
  double host_update_ms = 0.0;
  /// Trainable parameters whose update runs on the host, where the strategy counts them
  /// (hook_offload: all but those of units trained on the device); 0 where it does not.
  int64_t host_stepped_parameters = 0;
  std::map<std::string, DeviceMemory> devices;  ///< by device name ("cuda:0", "cpu")
};

/// Everything a strategy is built from. Strategy-specific knobs travel as text in `options` and are
/// parsed and validated by the strategy's own options struct.
struct StrategyConfig {
  torch::Device device{torch::kCPU};      ///< main device: inputs start here
  std::vector<torch::Device> devices;     ///< all devices the strategy may use; empty means {device}
  OptimizerConfig optimizer;
  PrecisionPolicy precision;              ///< fp32 by default; strategies that cannot honour another refuse it
  std::map<std::string, std::string> options;
  /// The ranks a multi-process strategy spans (distributed::first_ranks); empty: every rank of the
  /// launch. The sharded strategies take any; the pipelines, whose channels link the launch's
  /// ranks, only the whole world. Single-process strategies have no use for it.
  std::shared_ptr<distributed::Group> group;
};

class Strategy {
 public:
  Strategy() = default;
  virtual ~Strategy() = default;
  // A strategy owns device buffers, streams and the model's placement; a copy would alias them.
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;
  Strategy(Strategy&&) = default;
  Strategy& operator=(Strategy&&) = default;

  /// The registered name.
  virtual std::string name() const = 0;
  /// Takes over placement of the model's parameters and buffers (move, wrap, shard or stage them).
  /// Once per strategy object: a second call is an Error (a strategy's buffers, streams and
  /// optimizer state belong to one model; build a new strategy for another). Before attach() only
  /// name(), accumulates_gradients(), world_size() and reset_stats() answer; every other call is
  /// an Error that says to attach a model first.
  void attach(models::BlockModel model);
  /// Forward and backward over `batch` (host tensors); returns the mean loss over its targets
  /// (kIgnoreIndex ones left out). Gradients accumulate over train_steps until optimizer_step(),
  /// as with autograd's .grad, unless accumulates_gradients() says otherwise.
  virtual double train_step(const models::Batch& batch) = 0;
  /// False for a strategy that applies each step's gradients while backward runs (an overlapped
  /// optimizer): it requires optimizer_step() after every train_step and refuses a second
  /// train_step with an Error.
  virtual bool accumulates_gradients() const { return true; }
  /// Blocks until the work train_step queued for its backward (gradients on their way to where
  /// the strategy keeps them) has finished, so a timer can tell backward from optimizer time.
  /// Optimizer work overlapped with backward is not waited for.
  virtual void finish_backward() {}
  /// Forward only, without building a graph; returns the output on the strategy's last device.
  virtual torch::Tensor forward(const torch::Tensor& input) = 0;
  /// Blocks until everything earlier calls queued has finished, host optimizer updates that
  /// optimizer_step left running included: a timer over a series of steps stops after it.
  virtual void finish_step() {}
  /// One optimizer step wherever the strategy keeps master parameters, then zeroes gradients.
  /// A strategy whose updates run on the host may return before the last of them have run
  /// (hook_offload_overlap): whatever reads the parameters waits for the updates it needs (the
  /// next train_step's use of each block for that block's, forward() and parameters() for all).
  virtual void optimizer_step() = 0;
  /// Full, unsharded gradients as host tensors by canonical name (zeros where none accumulated).
  virtual NamedTensors gradients() = 0;
  /// Full, unsharded parameters as host tensors by canonical name.
  virtual NamedTensors parameters() = 0;
  /// The model's buffers (running statistics, fixed tables) as host tensors by canonical name.
  virtual NamedTensors buffers() = 0;
  /// Processes (ranks) the strategy's model spans; each is handed the global batch. 1 for
  /// single-process strategies.
  virtual int world_size() const { return 1; }
  /// Into how many slices train_step() splits a batch of `batch_size` samples, each slice's
  /// gradients computed apart and the slices' sums added (a pipeline's micro-batches, a
  /// data-parallel strategy's ranks); 1 for a strategy that runs the batch whole. The parity check
  /// widens its rounding floor by the slices' own sizes, which their sum rounds at (a gradient that
  /// cancels over the batch, after slices that do not). After attach(); never throws.
  virtual int64_t batch_slices(int64_t batch_size) const { return 1; }
  /// Whether the strategy trains under `policy`; Registry::create refuses the others with an
  /// Error naming both. fp32 only unless a strategy says more.
  virtual bool supports(const PrecisionPolicy& policy) const { return policy.is_fp32(); }
  /// The whole training state as host tensors by canonical name, for a checkpoint
  /// (strategies/state_files.h): each parameter (its fp32 master) under its name, its optimizer
  /// state as "<name>/exp_avg", "<name>/exp_avg_sq" (AdamW; SGD's momentum is exp_avg) and
  /// "<name>/step" where it has taken a step, each buffer (running statistics) under its name, and
  /// the loss scaler as "loss_scaler" (scale, good steps in a row, skipped steps). The tensors are
  /// the caller's copies: training on leaves them as they are (a background save writes them while
  /// the next steps run). After optimizer_step, with no gradient accumulated. A strategy that does
  /// not save its state yet: an Error naming it.
  virtual NamedTensors training_state();
  /// Takes a state training_state() returned, from this strategy or another of the same model:
  /// every parameter's name and shape must match (an Error names the first that does not). The
  /// next step goes on from it as if the steps it holds had run here.
  virtual void load_training_state(const NamedTensors& state);
  /// Bytes moved and memory held since the last reset_stats().
  virtual Stats stats() = 0;
  /// Zeroes the byte counters and the peaks (allocator peaks included).
  virtual void reset_stats() = 0;

 protected:
  /// attach() for the strategy, called at most once.
  virtual void attach_model(models::BlockModel model) = 0;

 private:
  bool attached_ = false;
};

/// Host copies (never views: the next step changes the originals) of named tensors, in order.
NamedTensors host_copies(const std::vector<models::NamedParameter>& tensors);

/// What load_training_state() checks before it changes anything, for strategy `strategy` holding
/// `params` and `buffers`: each parameter and buffer is in `state` with its shape, and each key of
/// `state` is one of their names, a parameter's optimizer slot (`/exp_avg`, `/exp_avg_sq`,
/// `/step`) or `loss_scaler`, whole or in pieces (training_state.h). An Error names the first that
/// is not; else the state's index.
StateIndex checked_training_state(const std::string& strategy, const std::vector<models::NamedParameter>& params,
                                  const std::vector<models::NamedBuffer>& buffers, const NamedTensors& state);
/// The buffers' values from a checked state, copied into `buffers` wherever they live.
void load_buffers(const std::vector<models::NamedBuffer>& buffers, const StateIndex& state);

using StrategyFactory = std::function<std::unique_ptr<Strategy>(const StrategyConfig&)>;

/// What one option of a strategy means (for `--list` and the table of options in docs/options.md).
struct OptionDoc {
  std::string key;
  std::string values;       ///< what it accepts, e.g. "0..", "recompute, keep"
  std::string text;         ///< what it does
  bool for_tests = false;   ///< plants or exposes a bug on purpose, or exists for a test's comparison
};

/// An option as a strategy's own parser asks for it, with its documentation.
struct OptionInfo {
  std::string key;
  std::string fallback;   ///< the value the strategy takes when none is given ("" for none)
  bool required = false;  ///< the strategy cannot run without it (fallback is then an example)
  OptionDoc doc;          ///< empty text when the option has no documentation
};

/// Strategies by name. Each strategy registers itself with one STRATA_REGISTER_STRATEGY line.
class Registry {
 public:
  /// Adds a strategy; a name registered twice is an Error. `required` names options the strategy
  /// cannot run without, with example values (e.g. a hand-written schedule): tests and the default
  /// benchmark list use those, the strategy refuses to be built without them.
  static void add(const std::string& name, const std::string& description, StrategyFactory factory,
                  std::map<std::string, std::string> required = {});
  /// Builds the strategy `name`; an unknown name is an Error that lists the registered ones.
  static std::unique_ptr<Strategy> create(const std::string& name, const StrategyConfig& config);
  /// Registered names, sorted.
  static std::vector<std::string> names();
  /// Registered names of the strategies that run without options, sorted: what a benchmark runs
  /// when none are named.
  static std::vector<std::string> default_names();
  static std::string description(const std::string& name);
  /// The options `name` needs, with example values; empty for a strategy that runs without options.
  static std::map<std::string, std::string> required_options(const std::string& name);
  /// Documents options of the strategies `names` (variants of one parser share its documentation).
  static void document(const std::vector<std::string>& names, std::vector<OptionDoc> docs);
  /// Every option `name` accepts, in its parser's order, with the default it runs with and its
  /// documentation. The list is what the parser asks for while the strategy is built (on the CPU,
  /// not attached) under an OptionReader::Recording, so it cannot drift from the code.
  static std::vector<OptionInfo> options(const std::string& name);
  /// The documentation registered for `name`'s options (a test compares it with options()).
  static std::vector<OptionDoc> documented(const std::string& name);
};

struct Registrar {
  Registrar(const std::string& name, const std::string& description, StrategyFactory factory,
            std::map<std::string, std::string> required = {}) {
    Registry::add(name, description, std::move(factory), std::move(required));
  }
};

/// Documents options at static initialisation, beside a STRATA_REGISTER_STRATEGY line:
/// `static const OptionDocumenter docs({"name", "name_variant"}, {{"key", "values", "what it does"}, ...});`
struct OptionDocumenter {
  OptionDocumenter(const std::vector<std::string>& names, std::vector<OptionDoc> docs) {
    Registry::document(names, std::move(docs));
  }
};

#define STRATA_CONCAT_INNER(a, b) a##b
#define STRATA_CONCAT(a, b) STRATA_CONCAT_INNER(a, b)
/// STRATA_REGISTER_STRATEGY("name", "what it is", [](const StrategyConfig& c) { return ...; });
/// (Named by __COUNTER__, not __LINE__: in a unity build several sources share one translation
/// unit, and two registrations on the same line of different files must not clash.)
#define STRATA_REGISTER_STRATEGY(name, description, factory) \
  static ::strata::Registrar STRATA_CONCAT(strata_registrar_, __COUNTER__)(name, description, factory)
/// The same for a strategy that needs options: `required` holds them with example values.
#define STRATA_REGISTER_STRATEGY_NEEDING(name, description, required, factory) \
  static ::strata::Registrar STRATA_CONCAT(strata_registrar_, __COUNTER__)(name, description, factory, required)

}  // namespace strata
