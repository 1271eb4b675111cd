#include "strategies/pipeline/pipeline.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "models/check.h"
#include "strategies/device/device.h"
#include "strategies/manual_split/manual_split.h"
#include "strategies/optimizer_state_io.h"
#include "strategies/options.h"

namespace strata {
namespace {

std::string comma_list(const std::vector<int64_t>& v) {
  std::ostringstream out;
  for (size_t i = 0; i < v.size(); ++i) out << (i ? "," : "") << v[i];
  return out.str();
}

void add_into_sum(torch::Tensor& sum, const torch::Tensor& part) {
  if (!part.defined()) return;
  if (!sum.defined())
    sum = part.detach().clone();
  else
    sum.add_(part.to(sum.device()));
}

/// How long a stage waits for a message before the step fails (a schedule the validator accepted
/// cannot stall; this catches a stage that died without saying so).
std::chrono::seconds receive_timeout() {
  const char* s = std::getenv("STRATA_DIST_TIMEOUT_S");
  return std::chrono::seconds(s ? std::max(1, std::atoi(s)) : 300);
}

}  // namespace

PipelineOptions PipelineOptions::parse(const std::map<std::string, std::string>& options) {
  OptionReader reader("pipeline", options);
  PipelineOptions o;
  o.schedule = reader.get_string("schedule", o.schedule);
  o.schedule_text = reader.get_string("schedule_text", "");
  const auto file = reader.get_string("schedule_file", "");
  if (!file.empty()) {
    STRATA_CHECK(o.schedule_text.empty(), "pipeline: give schedule_text or schedule_file, not both (schedule_file="
                                              << file << ")");
    std::ifstream in(file);
    STRATA_CHECK(in, "pipeline: schedule_file=" << file << " cannot be read");
    std::ostringstream text;
    text << in.rdbuf();
    o.schedule_text = text.str();
    STRATA_CHECK(!o.schedule_text.empty(), "pipeline: schedule_file=" << file << " is empty");
  }
  o.devices = reader.get_strings("devices", o.devices);
  o.ranks = reader.get_int("ranks", o.ranks);
  o.virtual_stages = reader.get_int("virtual_stages", o.virtual_stages);
  o.micro_batches = reader.get_int("micro_batches", o.micro_batches);
  const auto balance = reader.get_string("balance", "auto");
  if (balance != "auto") o.balance = reader.get_ints("balance", {});
  o.replicate_tied = reader.get_bool("replicate_tied", o.replicate_tied);
  o.debug_skip_waits = reader.get_bool("debug_skip_waits", o.debug_skip_waits);
  o.time_actions = reader.get_bool("time_actions", o.time_actions);
  reader.finish();
  o.validate();
  return o;
}

void PipelineOptions::validate() const {
  STRATA_CHECK(schedule == "gpipe" || schedule == "1f1b" || schedule == "interleaved" || schedule == "zb-h1" ||
                   schedule == "custom",
               "pipeline: schedule='" << schedule << "' is not valid; use gpipe, 1f1b, interleaved, zb-h1 or custom");
  STRATA_CHECK((schedule == "custom") == !schedule_text.empty(),
               "pipeline: schedule=" << schedule
                                     << (schedule == "custom" ? " needs the schedule: schedule_text=<text> or schedule_file=<path>"
                                                              : " generates its schedule; schedule_text and schedule_file "
                                                                "go with schedule=custom (strategy pipeline_custom)"));
  STRATA_CHECK(schedule != "custom" || virtual_stages == 0,
               "pipeline: the custom schedule's text fixes the stages per rank; leave out virtual_stages="
                   << virtual_stages);
  STRATA_CHECK(schedule != "custom" || micro_batches == 0,
               "pipeline: the custom schedule's text fixes the micro-batches; leave out micro_batches=" << micro_batches);
  STRATA_CHECK(ranks >= 0, "pipeline: ranks=" << ranks << " must not be negative");
  STRATA_CHECK(virtual_stages >= 0, "pipeline: virtual_stages=" << virtual_stages << " must not be negative");
  STRATA_CHECK(virtual_stages <= 1 || schedule == "interleaved",
               "pipeline: virtual_stages=" << virtual_stages << " needs schedule=interleaved, not " << schedule);
  STRATA_CHECK(micro_batches >= 0,
               "pipeline: micro_batches=" << micro_batches << " must be at least 1 (or 0: two per rank)");
  for (size_t i = 0; i < balance.size(); ++i)
    STRATA_CHECK(balance[i] >= 1, "pipeline: balance " << comma_list(balance) << " has an empty stage (stage " << i
                                                       << " gets " << balance[i] << " blocks)");
  for (const auto& d : devices) {
    try {
      device::parse(d);
    } catch (const Error& e) {
      STRATA_FAIL("pipeline: " << e.what());
    }
  }
}

// ---------------------------------------------------------------------------------------------
// One train_step's state, shared by the rank threads.

struct Message {
  torch::Tensor tensor;  ///< undefined: no gradient flows here (nothing upstream trains)
  device::Event ready;   ///< recorded on the sender's stream after the tensor was produced
};

struct Pipeline::Run {
  // The transport: messages by (is gradient, receiving stage, micro-batch).
  using Key = std::tuple<bool, int, int>;
  std::mutex mutex;
  std::condition_variable changed;
  std::map<Key, Message> mailbox;
  std::string failure;  ///< the first error of any rank; the others stop at their next receive
  bool failed = false;

  std::vector<torch::Tensor> inputs, targets;  ///< micro-batches, on the host
  double target_count = 1;
  std::vector<torch::Device> stage_device;
  std::vector<device::Stream> rank_stream;
  // Per stage (touched by the owning rank's thread only): per micro-batch, each block's kept graph
  // and, once its input gradient is taken (I), the gradient its output got (for W).
  struct Micro {
    std::vector<KeptGraph> graphs;
    std::vector<torch::Tensor> grad_outs;
    torch::Tensor loss_grad;  ///< last stage: the gradient of the loss at the stage's output
  };
  std::vector<std::vector<Micro>> micro;
  std::vector<std::vector<torch::Tensor>> stage_grads;  ///< stage -> parameter -> sum over its micro-batches
  std::vector<int> in_flight, peak;
  std::vector<torch::Tensor> losses;  ///< per micro-batch, on the last stage's device
  std::vector<int64_t> bytes;         ///< per rank (one process): bytes its messages moved to another device
  std::vector<distributed::Work> sends;  ///< c10d: this rank's messages in flight
  struct Timed {
    pipeline::Action action;
    device::Stopwatch watch;
  };
  std::vector<std::vector<Timed>> timed;  ///< rank -> its timed actions (time_actions)

  void fail(const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!failed) {
      failed = true;
      failure = what;
    }
    changed.notify_all();
  }
  void send(bool grad, int stage, int micro_batch, Message m) {
    std::lock_guard<std::mutex> lock(mutex);
    mailbox[{grad, stage, micro_batch}] = std::move(m);
    changed.notify_all();
  }
  Message receive(bool grad, int stage, int micro_batch) {
    std::unique_lock<std::mutex> lock(mutex);
    const Key key{grad, stage, micro_batch};
    const auto timeout = receive_timeout();
    const bool arrived = changed.wait_for(lock, timeout, [&] { return failed || mailbox.count(key) > 0; });
    if (failed) throw Error("pipeline: stopped because another stage failed");
    STRATA_CHECK(arrived, "pipeline: stage " << stage << " waited " << timeout.count() << " s for the "
                                             << (grad ? "gradient" : "activation") << " of micro-batch "
                                             << micro_batch << " (STRATA_DIST_TIMEOUT_S)");
    auto m = std::move(mailbox[key]);
    mailbox.erase(key);
    return m;
  }
};

// While alive, the replicated parameters of a block hold the stage's replica data; every block using
// a replicated parameter holds its lock, so no other stage reads or swaps it meanwhile.
class Pipeline::Swap {
 public:
  Swap(Pipeline& p, int64_t stage, int64_t block) : p_(p) {
    auto& params = p.model().parameters();
    std::vector<int64_t> mine;
    for (auto i : p.block_params_[block])
      if (p.locked_[i] && std::find(mine.begin(), mine.end(), i) == mine.end()) mine.push_back(i);
    std::sort(mine.begin(), mine.end());  // one order for all: no deadlock
    for (auto i : mine) locks_.emplace_back(*p.locks_[i]);
    for (const auto& r : p.replicas_[stage]) {
      if (std::find(mine.begin(), mine.end(), r.param) == mine.end()) continue;
      auto& t = params[r.param].tensor;
      swapped_.push_back({t, t.data()});
      t.set_data(r.value);
    }
  }
  ~Swap() {
    for (auto& [t, home] : swapped_) t.set_data(home);
  }
  Swap(const Swap&) = delete;
  Swap& operator=(const Swap&) = delete;

 private:
  Pipeline& p_;
  std::vector<std::unique_lock<std::mutex>> locks_;
  std::vector<std::pair<torch::Tensor, torch::Tensor>> swapped_;
};

// ---------------------------------------------------------------------------------------------

Pipeline::Pipeline(std::string name, const StrategyConfig& config, PipelineOptions options)
    : name_(std::move(name)), config_(config), options_(std::move(options)), scaler_(config.precision) {
  device::check_available(config_.device);
  if (custom()) {
    try {
      custom_ = pipeline::parse(options_.schedule_text);
      pipeline::validate(custom_);
    } catch (const Error& e) {
      STRATA_FAIL(name_ << ": the custom schedule is not runnable: " << e.what());
    }
  }
}

models::BlockModel& Pipeline::model() {
  STRATA_CHECK(model_.has_value(), name_ << ": attach() a model first");
  return *model_;
}

bool Pipeline::ranks_share_a_device() const {
  if (c10d_) return false;  // one rank per process
  for (size_t a = 0; a < rank_devices_.size(); ++a)
    for (size_t b = a + 1; b < rank_devices_.size(); ++b)
      if (rank_devices_[a] == rank_devices_[b]) return true;
  return false;
}

torch::Device Pipeline::device_of_stage(int64_t stage) const {
  return rank_devices_[static_cast<size_t>(schedule_.rank_of(static_cast<int>(stage)))];
}

int64_t Pipeline::micro_batches_for(int64_t n) const {
  const auto p = static_cast<int64_t>(rank_devices_.size());
  if (custom()) {
    STRATA_CHECK(n >= custom_.micro_batches, name_ << ": a batch of " << n << " samples cannot be split into the "
                                                   << custom_.micro_batches
                                                   << " micro-batches of the custom schedule; give at least one "
                                                      "sample per micro-batch");
    return custom_.micro_batches;
  }
  const bool interleaved = options_.schedule == "interleaved";
  if (options_.micro_batches > 0) {
    STRATA_CHECK(n >= options_.micro_batches, name_ << ": a batch of " << n << " samples cannot be split into "
                                                    << options_.micro_batches
                                                    << " micro-batches; give at least one sample per micro-batch or "
                                                       "lower micro_batches");
    return options_.micro_batches;
  }
  if (!interleaved) return std::min(2 * p, n);
  STRATA_CHECK(n >= p, name_ << ": a batch of " << n << " samples cannot be split into a multiple of the " << p
                             << " ranks' micro-batches (interleaved 1F1B sends them in groups of the ranks)");
  return std::min(2 * p, n / p * p);
}

int64_t Pipeline::batch_slices(int64_t batch_size) const {
  if (rank_devices_.empty()) return 1;  // not attached
  try {
    return std::max<int64_t>(1, micro_batches_for(batch_size));
  } catch (const Error&) {
    return 1;
  }
}

void Pipeline::build_schedule(int64_t micro_batches) {
  if (!schedule_.actions.empty() && schedule_.micro_batches == micro_batches) return;
  const int p = static_cast<int>(rank_devices_.size()), m = static_cast<int>(micro_batches);
  const int64_t v = virtual_stages_;
  if (custom())
    schedule_ = custom_;
  else if (options_.schedule == "gpipe")
    schedule_ = pipeline::gpipe(p, m);
  else if (options_.schedule == "1f1b")
    schedule_ = pipeline::one_f_one_b(p, m);
  else if (options_.schedule == "interleaved")
    schedule_ = pipeline::interleaved_1f1b(p, m, static_cast<int>(v));
  else
    schedule_ = pipeline::zero_bubble_h1(p, m);
  pipeline::validate(schedule_);
}

void Pipeline::attach_model(models::BlockModel model) {
  check_buffers_under(config_.precision, model, name_);
  const auto n = model.num_blocks();
  // Ranks: the options' devices, else the config's, else `ranks` copies of the main device.
  std::vector<torch::Device> devices;
  const auto& env = distributed::environment();
  c10d_ = env.launched && env.world_size > 1;
  STRATA_CHECK(!config_.group || config_.group->size() == env.world_size,
               name_ << ": runs over every rank of the launch (its channels link the launch's ranks); a group of "
                     << config_.group->size() << " of its " << env.world_size << " ranks is not taken");
  if (c10d_) {
    // One process per rank (torchrun, launch.py): this process is rank RANK on its own device.
    STRATA_CHECK(options_.devices.empty() && (options_.ranks == 0 || options_.ranks == env.world_size),
                 name_ << ": launched as " << env.world_size << " processes, each is one rank on its own device;"
                       << " leave out devices= and ranks= (given: devices=" << options_.devices.size()
                       << " entries, ranks=" << options_.ranks << ")");
    const auto mine = distributed::rank_device(config_.device);
    devices.assign(static_cast<size_t>(env.world_size), mine);
    my_rank_ = env.rank;
    group_ = distributed::group_for(mine);
  } else if (!options_.devices.empty()) {
    for (const auto& d : options_.devices) devices.push_back(device::parse(d));
  } else if (!config_.devices.empty() && options_.ranks == 0) {
    devices = config_.devices;
  } else {
    const int64_t r = options_.ranks > 0 ? options_.ranks : custom() ? custom_.ranks : std::min<int64_t>(2, n);
    devices.assign(static_cast<size_t>(r), config_.device);
  }
  for (const auto& d : devices) device::check_available(d);
  const int64_t p = static_cast<int64_t>(devices.size());
  STRATA_CHECK(!custom() || p == custom_.ranks, name_ << ": the custom schedule has " << custom_.ranks
                                                      << " rank lines but the strategy runs " << p
                                                      << " ranks (devices, ranks= or processes); make them agree");
  const int64_t v = custom()                                   ? custom_.virtual_stages
                    : options_.virtual_stages > 0                ? options_.virtual_stages
                    : options_.schedule != "interleaved"         ? 1
                                                                 : std::clamp<int64_t>(n / p, 1, 2);
  const int64_t stages = p * v;
  STRATA_CHECK(stages <= n, name_ << ": " << stages << " stages (" << p << " ranks x " << v
                                  << " virtual stages) need at least as many blocks; the model has " << n);
  if (!options_.balance.empty())
    STRATA_CHECK(static_cast<int64_t>(options_.balance.size()) == stages &&
                     std::accumulate(options_.balance.begin(), options_.balance.end(), int64_t{0}) == n,
                 name_ << ": balance " << comma_list(options_.balance) << " must give " << stages << " stages (" << p
                       << " ranks x " << v << ") blocks summing to the model's " << n);
  rank_devices_ = devices;
  rank_streams_.clear();
  for (const auto& d : devices) rank_streams_.push_back(d.is_cuda() ? device::Stream::side(d) : device::Stream::compute(d));
  if (c10d_) {
    std::ostringstream layout;
    for (const auto& p : model.parameters()) layout << p.name << p.tensor.sizes() << p.tensor.requires_grad() << ";";
    for (const auto& b : model.buffers()) layout << b.name << b.tensor.sizes() << ";";
    std::ostringstream description;
    description << name_ << "(schedule " << options_.schedule << ", micro_batches " << options_.micro_batches
                << ", virtual_stages " << v << ", balance " << comma_list(options_.balance) << ", schedule text #"
                << std::hash<std::string>{}(custom() ? pipeline::to_text(custom_) : std::string()) << ") world " << p
                << ", model of " << model.parameters().size() << " parameters, layout #" << std::hex
                << std::hash<std::string>{}(layout.str());
    group_->agree(name_ + " attach", description.str());
  }
  virtual_stages_ = v;
  schedule_ = {};
  build_schedule(custom() ? custom_.micro_batches : options_.micro_batches > 0 ? options_.micro_batches : 2 * p);

  const auto& params = model.parameters();
  // Each block's parameters, in its parameters() order, as canonical indices.
  std::map<const void*, int64_t> index_of;
  for (size_t i = 0; i < params.size(); ++i) index_of[params[i].tensor.unsafeGetTensorImpl()] = static_cast<int64_t>(i);
  block_params_.assign(static_cast<size_t>(n), {});
  std::vector<double> weights(static_cast<size_t>(n), 0.0);
  for (int64_t b = 0; b < n; ++b)
    for (const auto& t : model.blocks()[b]->parameters()) {
      block_params_[b].push_back(index_of.at(t.unsafeGetTensorImpl()));
      weights[b] += static_cast<double>(t.numel());
    }
  balance_ = options_.balance.empty() ? ManualSplit::partition(weights, stages) : options_.balance;
  first_block_.assign(1, 0);
  for (auto k : balance_) first_block_.push_back(first_block_.back() + k);
  std::vector<int64_t> stage_of(static_cast<size_t>(n));
  for (int64_t s = 0; s < stages; ++s)
    for (int64_t b = first_block_[s]; b < first_block_[s + 1]; ++b) stage_of[b] = s;

  // Home stage of each parameter: its first user. Replicas where another user computes elsewhere.
  home_stage_.assign(params.size(), -1);
  replicas_.assign(static_cast<size_t>(stages), {});
  locked_.assign(params.size(), false);
  locks_.clear();
  for (size_t i = 0; i < params.size(); ++i) locks_.push_back(std::make_unique<std::mutex>());
  for (int64_t b = 0; b < n; ++b)
    for (auto i : block_params_[b])
      if (home_stage_[i] < 0) home_stage_[i] = stage_of[b];
  // Buffers move with their block; one shared by blocks on two devices has no single place.
  auto& buffer_stage = buffer_stage_;
  buffer_stage.assign(model.buffers().size(), -1);
  for (int64_t b = 0; b < n; ++b)
    for (auto k : model.block_buffers()[b]) {
      const auto s = stage_of[b];
      if (buffer_stage[k] >= 0)
        STRATA_CHECK(device_of_stage(buffer_stage[k]) == device_of_stage(s),
                     name_ << ": buffer '" << model.buffers()[k].name << "' is used by stages on "
                           << device_of_stage(buffer_stage[k]) << " and " << device_of_stage(s)
                           << "; a pipeline cannot place a shared buffer on both");
      else
        buffer_stage[k] = s;
    }
  // Move: parameters to their home device, buffers to their stage's.
  {
    torch::NoGradGuard no_grad;
    // Across processes, a parameter goes to this rank's device if a stage here uses it (a shared
    // one used on several ranks is a copy on each, kept equal by summing its gradient over them);
    // the others stay on the host, unused.
    auto& here = local_param_;
    here.assign(params.size(), !c10d_);
    shared_param_.assign(params.size(), false);
    if (c10d_) {
      std::vector<std::set<int>> users(params.size());
      for (int64_t b = 0; b < n; ++b)
        for (auto i : block_params_[b]) {
          users[i].insert(schedule_.rank_of(static_cast<int>(stage_of[b])));
          if (local_stage(stage_of[b])) here[i] = true;
        }
      for (size_t i = 0; i < params.size(); ++i) shared_param_[i] = params[i].tensor.requires_grad() && users[i].size() > 1;
    }
    for (size_t i = 0; i < params.size(); ++i) {
      auto& t = params[i].tensor;
      if (home_stage_[i] >= 0 && here[i]) t.set_data(t.data().to(c10d_ ? rank_devices_[my_rank_] : device_of_stage(home_stage_[i])));
    }
    for (size_t k = 0; k < buffer_stage.size(); ++k) {
      auto& t = model.buffers()[k].tensor;
      if (buffer_stage[k] >= 0 && local_stage(buffer_stage[k])) t.set_data(t.data().to(device_of_stage(buffer_stage[k])));
    }
    for (int64_t s = 0; s < stages && !c10d_; ++s) {
      std::vector<int64_t> seen;
      for (int64_t b = first_block_[s]; b < first_block_[s + 1]; ++b)
        for (auto i : block_params_[b]) {
          if (home_stage_[i] == s || std::find(seen.begin(), seen.end(), i) != seen.end()) continue;
          seen.push_back(i);
          const bool other_device = device_of_stage(home_stage_[i]) != device_of_stage(s);
          if (!other_device && !options_.replicate_tied) continue;  // same values, same device: share
          auto value = params[i].tensor.detach().to(device_of_stage(s), /*non_blocking=*/false, /*copy=*/true);
          value.requires_grad_(params[i].tensor.requires_grad());
          replicas_[s].push_back({i, value});
          locked_[i] = true;
        }
    }
  }
  grads_.assign(params.size(), torch::Tensor());
  optimizer_state_.assign(params.size(), OptimizerState{});
  {
    // Across processes, only the parameters this rank computes with (the others stay fp32 on the
    // host, unused).
    std::vector<torch::Tensor> computed;
    for (size_t i = 0; i < params.size(); ++i)
      if (local_param_[i]) computed.push_back(params[i].tensor);
    for (auto& stage : replicas_)
      for (auto& r : stage) computed.push_back(r.value);
    copies_ = ComputeCopies(config_.precision, std::move(computed));
  }
  peak_in_flight_.assign(static_cast<size_t>(stages), 0);
  model_.emplace(std::move(model));
  if (c10d_) {
    // Channels to and from each neighbouring rank, opened in one order on every process (opening
    // one waits for the other side), each direction with its own receiving stream here.
    std::set<std::pair<int, int>> links;
    for (int64_t s = 0; s + 1 < stages; ++s) {
      const int a = schedule_.rank_of(static_cast<int>(s)), b = schedule_.rank_of(static_cast<int>(s + 1));
      if (a == b) continue;
      links.insert({a, b});
      links.insert({b, a});
    }
    // Each channel also carries one empty message here, in that order: NCCL makes a channel's
    // communicator at its first message, and a communicator made while another channel's transfer
    // is in flight can wait on it forever (seen: both ranks stuck in the first step); made here,
    // one at a time, every later message finds its communicator ready.
    const auto mine = rank_devices_[my_rank_];
    for (const auto& [from, to] : links) {
      if (from != my_rank_ && to != my_rank_) continue;
      auto ch = distributed::channel(mine, from, to);
      if (from == my_rank_) {
        outgoing_.push_back(ch);
        ch->send(torch::Tensor()).wait();
      } else {
        ch->receive();
        receive_streams_.emplace(from, mine.is_cuda() ? device::Stream::side(mine) : device::Stream::compute(mine));
      }
      device::synchronize(mine);
    }
  }
}

void Pipeline::record_costs(Run& run) {
  const int stages = schedule_.num_stages();
  // stage x {F, B, I, W} x {sum of ms, count}; across processes every rank adds its own stages.
  auto table = torch::zeros({stages, 4, 2}, torch::kFloat64);
  auto t = table.accessor<double, 3>();
  for (auto& list : run.timed)
    for (auto& timed : list) {
      const int op = static_cast<int>(timed.action.op == pipeline::Op::F   ? 0
                                      : timed.action.op == pipeline::Op::B ? 1
                                      : timed.action.op == pipeline::Op::I ? 2
                                                                           : 3);
      t[timed.action.stage][op][0] += timed.watch.elapsed_ms();
      t[timed.action.stage][op][1] += 1;
    }
  if (c10d_) {
    auto shared = table.to(rank_devices_[my_rank_]);
    group_->all_reduce(shared).wait();
    table = shared.cpu();
    t = table.accessor<double, 3>();
  }
  auto mean = [&](int s, int op) { return t[s][op][1] > 0 ? t[s][op][0] / t[s][op][1] : 0.0; };
  last_costs_ = {};
  last_costs_.stages.clear();
  for (int s = 0; s < stages; ++s) last_costs_.stages.push_back({mean(s, 0), mean(s, 1), mean(s, 2), mean(s, 3)});
}

double Pipeline::simulated_ms() const {
  STRATA_CHECK(options_.time_actions && !last_costs_.stages.empty() &&
                   static_cast<int>(last_costs_.stages.size()) == schedule_.num_stages(),
               name_ << ": simulated_ms() needs time_actions=1 and a train_step");
  return pipeline::simulate(schedule_, last_costs_).makespan;
}

int64_t Pipeline::channel_bytes_sent() const {
  int64_t total = 0;
  for (const auto& ch : outgoing_) total += ch->bytes_sent();
  return total;
}

void Pipeline::count_all_reduce(const torch::Tensor& t) {
  bytes_interconnect_ += distributed::ring_all_reduce_bytes(t.nbytes(), static_cast<int>(rank_devices_.size()));
}

std::shared_ptr<distributed::Channel> Pipeline::channel_to(int rank, bool outgoing) const {
  const auto mine = rank_devices_[my_rank_];
  return outgoing ? distributed::channel(mine, my_rank_, rank) : distributed::channel(mine, rank, my_rank_);
}

// The messages `rank`'s actions send, in the order it sends them: (gradient?, receiving stage,
// micro-batch). A receiver posts its receives in this order, the order the sender's channel has.
namespace {
std::vector<std::tuple<bool, int, int>> sends_of(const pipeline::Schedule& schedule, int rank, size_t from_action = 0) {
  std::vector<std::tuple<bool, int, int>> out;
  const int last = schedule.num_stages() - 1;
  const auto& actions = schedule.actions[static_cast<size_t>(rank)];
  for (size_t k = from_action; k < actions.size(); ++k) {
    const auto& a = actions[k];
    if (a.op == pipeline::Op::F && a.stage < last) out.emplace_back(false, a.stage + 1, a.micro);
    if ((a.op == pipeline::Op::B || a.op == pipeline::Op::I) && a.stage > 0) out.emplace_back(true, a.stage - 1, a.micro);
  }
  return out;
}
}  // namespace

void Pipeline::send_remote(Run& run, int to_stage, const torch::Tensor& t) {
  run.sends.push_back(channel_to(schedule_.rank_of(to_stage), /*outgoing=*/true)->send(t));
}

// After this rank's action `from_action` failed: every message it would still have sent to
// another rank goes as the failure, so each receiver ends its step with the error, not a wait.
void Pipeline::fail_remaining(Run& run, size_t from_action) {
  for (const auto& [grad, stage, micro] : sends_of(schedule_, my_rank_, from_action)) {
    const int to = schedule_.rank_of(stage);
    if (to == my_rank_) continue;
    try {
      run.sends.push_back(channel_to(to, /*outgoing=*/true)->send_failure(run.failure));
    } catch (const std::exception&) {  // the peer may be gone; the step fails either way
    }
  }
}

// Receives what `peer` sends this rank in one step, in its order, into the mailbox.
void Pipeline::receive_from(Run& run, int peer) {
  const auto dev = rank_devices_[my_rank_];
  c10::OptionalDeviceGuard on_device;
  if (dev.is_cuda()) on_device.reset_device(dev);
  auto& stream = receive_streams_.at(peer);
  device::Stream::Guard on_stream(stream);
  auto ch = channel_to(peer, /*outgoing=*/false);
  for (const auto& [grad, stage, micro] : sends_of(schedule_, peer)) {
    if (schedule_.rank_of(stage) != my_rank_) continue;
    try {
      auto r = ch->receive();
      if (r.failed) {
        run.fail(r.failure);
        continue;  // the rest from this peer are failures too: take them, so its sends complete
      }
      run.send(grad, stage, micro, Message{r.tensor, stream.record()});
    } catch (const std::exception& e) {
      run.fail(std::string("rank ") + std::to_string(my_rank_) + " receiving from rank " + std::to_string(peer) +
               ": " + e.what());
      return;
    }
  }
}

// After this rank's actions: the sends are done, every rank learns whether any failed, the loss and
// the gradients of parameters held on several ranks are summed over the ranks.
void Pipeline::finish_remote_step(Run& run) {
  for (auto& w : run.sends) w.wait();
  run.sends.clear();
  const auto dev = rank_devices_[my_rank_];
  auto flag = torch::tensor({run.failed ? 1.0f : 0.0f}, torch::TensorOptions().device(dev));
  group_->all_reduce(flag, /*max=*/true).wait();
  count_all_reduce(flag);
  if (flag.item<float>() > 0)
    throw Error(name_ + ": " + (run.failed ? run.failure : "a stage on another rank failed (its error is in that rank's output)"));
}


// ---------------------------------------------------------------------------------------------

void Pipeline::run_action(Run& run, const pipeline::Action& a) {
  auto& m = model();
  const int s = a.stage, i = a.micro;
  const int last = schedule_.num_stages() - 1;
  const auto dev = run.stage_device[s];
  auto& stream = run.rank_stream[schedule_.rank_of(s)];
  auto& state = run.micro[s][i];
  // time_actions: the action's own compute, from after its input arrived to before it sends.
  Run::Timed* timer = nullptr;
  auto start_timer = [&] {
    if (!options_.time_actions) return;
    auto& list = run.timed[static_cast<size_t>(schedule_.rank_of(s))];
    list.push_back({a, device::Stopwatch(dev)});
    timer = &list.back();
    timer->watch.start();
  };
  auto stop_timer = [&] {
    if (timer) timer->watch.stop();
  };
  // The sender moves a tensor to the receiving stage's device on its own stream (the copy then
  // runs on the source device, in the order of the work that produced it) and records an event;
  // the receiver's stream waits for that event only, and marks the tensor in use by its stream.
  auto take = [&](bool grad) {
    auto msg = run.receive(grad, s, i);
    if (!msg.tensor.defined()) return torch::Tensor();
    if (!options_.debug_skip_waits) stream.wait(msg.ready);
    stream.keep_alive(msg.tensor);
    return msg.tensor;
  };
  auto give = [&](bool grad, int to, torch::Tensor t) {
    if (c10d_ && schedule_.rank_of(to) != my_rank_) {  // another process: over its channel, in order
      const auto delay = device::injected_delays().copy;
      if (delay.count() > 0) stream.delay(delay);
      send_remote(run, to, t);
      return;
    }
    const auto& target = run.stage_device[to];
    if (t.defined() && t.device() != target) {
      run.bytes[schedule_.rank_of(s)] += t.nbytes();
      t = t.to(target, /*non_blocking=*/true);
    }
    const auto delay = device::injected_delays().copy;
    if (delay.count() > 0) stream.delay(delay);  // a slow link: the receiver must wait for the event
    run.send(grad, to, i, Message{t, stream.record()});
  };
  auto add_grads = [&](int64_t block, const std::vector<torch::Tensor>& g) {
    for (size_t k = 0; k < g.size(); ++k) {
      if (!g[k].defined()) continue;
      // Micro-batches' gradients are summed in the reduction dtype (a no-op under fp32).
      // Summed in place into a tensor of the step's own (a gradient from backward may share
      // storage with the output gradient that travels on to the previous stage): a 4.6B-parameter
      // classifier's gradient is 17 GiB in fp32, and an out-of-place sum would hold three at once.
      const auto gk = g[k].to(config_.precision.reduce);
      auto& sum = run.stage_grads[s][block_params_[block][k]];
      if (!sum.defined())
        sum = gk.is_same(g[k]) ? gk.clone() : gk;
      else
        sum.add_(gk);
    }
  };

  if (a.op == pipeline::Op::F) {
    auto x = s == 0 ? config_.precision.cast_input(run.inputs[i].to(dev)) : take(false);
    if (schedule_.rank_of(s) == 0) stream.compute_point();  // one rank's compute slowed (tests)
    start_timer();
    for (int64_t b = first_block_[s]; b < first_block_[s + 1]; ++b) {
      Swap swap(*this, s, b);
      auto [y, graph] = run_keeping_graph(*m.blocks()[b], x);
      state.graphs.push_back(std::move(graph));
      x = y;
    }
    if (s == last) {
      // The loss's gradient with respect to the last stage's output, taken directly (no leaf's
      // .grad to accumulate into, so nothing crosses from the engine back to another stream).
      auto out = x.detach().requires_grad_(x.is_floating_point());
      auto loss = m.loss_sum(out, run.targets[i].to(dev)) / run.target_count;
      // fp16: the loss scale enters here, so every gradient behind it carries it.
      if (out.requires_grad())
        state.loss_grad = torch::autograd::grad({scaler_.scaled(loss)}, {out})[0];
      run.losses[i] = loss.detach();
      stop_timer();
    } else {
      stop_timer();
      give(false, s + 1, x);
    }
    run.peak[s] = std::max(run.peak[s], ++run.in_flight[s]);
    return;
  }

  const int64_t first = first_block_[s], count = first_block_[s + 1] - first;
  if (a.op == pipeline::Op::B || a.op == pipeline::Op::I) {
    auto g = s == last ? state.loss_grad : take(true);
    if (schedule_.rank_of(s) == 0) stream.compute_point();
    start_timer();
    const bool split = a.op == pipeline::Op::I;
    if (split) state.grad_outs.assign(static_cast<size_t>(count), torch::Tensor());
    for (int64_t k = count - 1; k >= 0; --k) {
      const int64_t b = first + k;
      auto& graph = state.graphs[static_cast<size_t>(k)];
      if (!g.defined() || !graph.output.is_valid()) {  // nothing here trains or needs a gradient
        graph = KeptGraph{};
        g = torch::Tensor();
        continue;
      }
      Swap swap(*this, s, b);
      if (split) {
        state.grad_outs[static_cast<size_t>(k)] = g;
        g = input_gradient(graph, {g});
      } else {
        auto r = block_gradients(std::move(graph), {g});
        add_grads(b, r.params);
        g = r.input;
      }
    }
    stop_timer();
    if (s > 0) give(true, s - 1, g);
    if (!split) {
      state = Run::Micro{};
      --run.in_flight[s];
    }
    return;
  }

  // W: the weight gradients from the graphs that I kept and the output gradients it saw.
  start_timer();
  for (int64_t k = 0; k < count; ++k) {
    auto& graph = state.graphs[static_cast<size_t>(k)];
    const auto& g = state.grad_outs.empty() ? torch::Tensor() : state.grad_outs[static_cast<size_t>(k)];
    if (!g.defined() || !graph.output.is_valid()) continue;
    Swap swap(*this, s, first + k);
    add_grads(first + k, block_gradients(std::move(graph), {g}).params);
  }
  stop_timer();
  state = Run::Micro{};
  --run.in_flight[s];
}

void Pipeline::run_rank(Run& run, int rank) {
  const auto dev = rank_devices_[static_cast<size_t>(rank)];
  c10::OptionalDeviceGuard on_device;
  if (dev.is_cuda()) on_device.reset_device(dev);
  device::Stream::Guard on_stream(run.rank_stream[static_cast<size_t>(rank)]);
  const auto& actions = schedule_.actions[static_cast<size_t>(rank)];
  for (size_t k = 0; k < actions.size(); ++k) {
    try {
      run_action(run, actions[k]);
    } catch (const std::exception& e) {
      std::ostringstream what;
      what << "rank " << rank << " (" << dev << "), action " << k << " '"
           << pipeline::token(actions[k], schedule_.virtual_stages > 1) << "'";
      // The micro-batch's size: a block that needs several samples (BatchNorm's statistics) fails
      // on the split, not on the batch the caller gave.
      const auto micro = static_cast<size_t>(actions[k].micro);
      if (micro < run.inputs.size() && run.inputs[micro].dim() > 0) {
        int64_t samples = 0;
        for (const auto& in : run.inputs) samples += in.dim() > 0 ? in.size(0) : 0;
        what << " (micro-batch " << micro << ": " << run.inputs[micro].size(0) << " of the batch's " << samples
             << " samples, split into " << run.inputs.size() << " micro-batches)";
      }
      what << ": " << e.what();
      run.fail(what.str());
      if (c10d_) fail_remaining(run, k);
      return;
    }
  }
}

double Pipeline::train_step(const models::Batch& batch) {
  auto& m = model();
  const int64_t n = batch.input.size(0), mb = micro_batches_for(n);
  build_schedule(mb);
  const int stages = schedule_.num_stages();
  Run run;
  run.target_count = static_cast<double>(models::BlockModel::count_targets(batch.target));
  for (int64_t i = 0; i < mb; ++i) {  // sizes differ by at most one: the first n % mb get one more
    const int64_t lo = n * i / mb, hi = n * (i + 1) / mb;
    run.inputs.push_back(batch.input.narrow(0, lo, hi - lo));
    run.targets.push_back(batch.target.narrow(0, lo, hi - lo));
  }
  bytes_h2d_ += batch.input.nbytes() + batch.target.nbytes();
  for (int s = 0; s < stages; ++s) run.stage_device.push_back(device_of_stage(s));
  run.rank_stream = rank_streams_;
  run.micro.assign(static_cast<size_t>(stages), std::vector<Run::Micro>(static_cast<size_t>(mb)));
  run.stage_grads.assign(static_cast<size_t>(stages), std::vector<torch::Tensor>(m.parameters().size()));
  run.in_flight.assign(static_cast<size_t>(stages), 0);
  run.peak.assign(static_cast<size_t>(stages), 0);
  run.losses.assign(static_cast<size_t>(mb), torch::Tensor());
  run.bytes.assign(rank_devices_.size(), 0);
  run.timed.assign(rank_devices_.size(), {});
  // The stages compute in the policy's dtype while the actions run. Bound before the ranks'
  // streams take their start from the compute stream (the casts are queued there), and unbound
  // only once every device has finished with the copies.
  ComputeCopies::Scope bound(copies_);
  // Each rank's stream starts after the work queued so far (the last step's updates).
  for (size_t r = 0; r < rank_devices_.size(); ++r)
    if (rank_devices_[r].is_cuda()) run.rank_stream[r].wait(device::Stream::compute(rank_devices_[r]).record());

  // Workers: key r >= 0 runs rank r's actions; key -1 - q receives what rank q sends this process.
  auto worker = [this](int key) -> device::HostQueue& {
    auto& w = workers_[key];
    if (!w) w = std::make_unique<device::HostQueue>();
    return *w;
  };
  std::vector<device::HostQueue*> busy;
  const int64_t sent_before = c10d_ ? channel_bytes_sent() : 0;
  if (c10d_) {  // this process's rank, and a receiver per rank that sends it anything
    busy.push_back(&worker(my_rank_));
    busy.back()->submit([this, &run] { run_rank(run, my_rank_); });
    for (auto& [peer, stream] : receive_streams_) {
      busy.push_back(&worker(-1 - peer));
      busy.back()->submit([this, &run, peer = peer] { receive_from(run, peer); });
    }
  } else {
    for (int r = 0; r < schedule_.ranks; ++r) {
      busy.push_back(&worker(r));
      busy.back()->submit([this, &run, r] { run_rank(run, r); });
    }
  }
  for (auto* w : busy) w->drain();  // run_rank and receive_from catch their own errors
  // Across processes: what this rank's channels sent in the step (headers included), as they
  // counted it.
  if (c10d_) bytes_interconnect_ += channel_bytes_sent() - sent_before;
  if (c10d_) {
    device::Stream::Guard on_stream(run.rank_stream[static_cast<size_t>(my_rank_)]);
    try {
      finish_remote_step(run);
    } catch (...) {
      // The compute copies are released on the way out: nothing queued may still read them.
      for (const auto& d : rank_devices_) {
        try {
          device::synchronize(d);
        } catch (...) {  // the step's own error is the one to report
        }
      }
      throw;
    }
  }
  for (const auto& d : rank_devices_) device::synchronize(d);
  bound.commit();  // the masters back: the sums below are taken in their dtype
  if (run.failed) throw Error(name_ + ": " + run.failure);
  if (options_.time_actions) record_costs(run);

  for (auto b : run.bytes) bytes_interconnect_ += b;
  peak_in_flight_ = run.peak;
  // Each parameter's gradient: the sum over the stages that used it, on its home device. Across
  // processes, a parameter used on several ranks (the tied embedding and head) has a copy on each:
  // this step's part of its gradient is summed over all ranks (zeros where unused) before it is
  // added, so every copy takes the same step.
  torch::NoGradGuard no_grad;
  const auto& params = m.parameters();
  const auto& shared = shared_param_;
  std::vector<torch::Tensor> step(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].tensor.requires_grad()) continue;
    for (int s = 0; s < stages; ++s) {
      const auto& g = run.stage_grads[static_cast<size_t>(s)][i];
      if (!g.defined()) continue;
      if (g.device() != params[i].tensor.device()) bytes_interconnect_ += g.nbytes();
      // Compute-dtype gradients join the fp32 sums (the masters' dtype) here. The stages' sums are
      // the step's own (made above, dropped with `run`): the first one is taken, not copied.
      auto& sum = shared[i] ? step[i] : grads_[i];
      auto part = g.to(params[i].tensor.device(), params[i].tensor.scalar_type());
      if (!sum.defined())
        sum = part.detach();
      else
        sum.add_(part);
    }
  }
  double loss = 0;
  for (const auto& l : run.losses)
    if (l.defined()) loss += l.item<double>();
  if (!c10d_) return loss;

  // The loss is known on the last stage's rank: every rank returns it.
  const auto dev = rank_devices_[my_rank_];
  auto total = torch::tensor({loss}, torch::TensorOptions().dtype(torch::kFloat64).device(dev));
  group_->all_reduce(total).wait();
  count_all_reduce(total);
  loss = total.item<double>();
  const auto& here = local_param_;
  std::vector<size_t> summed;
  std::vector<torch::Tensor> parts;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!shared[i]) continue;
    summed.push_back(i);
    parts.push_back(step[i].defined() ? step[i].reshape(-1)
                                      : torch::zeros({params[i].tensor.numel()}, torch::TensorOptions().device(dev)));
  }
  if (summed.empty()) return loss;
  // Which got a gradient on some rank: one that got none anywhere stays without (no update).
  auto got = torch::zeros({static_cast<int64_t>(summed.size())}, torch::TensorOptions().device(dev));
  for (size_t k = 0; k < summed.size(); ++k)
    if (step[summed[k]].defined()) got[static_cast<int64_t>(k)] = 1;
  auto flat = torch::cat(parts);
  group_->all_reduce(flat).wait();
  group_->all_reduce(got).wait();
  count_all_reduce(flat);
  count_all_reduce(got);
  got = got.cpu();
  int64_t at = 0;
  for (size_t k = 0; k < summed.size(); ++k) {
    const auto i = summed[k];
    const auto n = params[i].tensor.numel();
    if (got[static_cast<int64_t>(k)].item<float>() > 0 && here[i])
      add_into_sum(grads_[i], flat.narrow(0, at, n).view(params[i].tensor.sizes()));
    at += n;
  }
  return loss;
}

torch::Tensor Pipeline::forward(const torch::Tensor& input) {
  auto& m = model();
  torch::NoGradGuard no_grad;
  bytes_h2d_ += input.nbytes();
  auto x = input;
  if (c10d_) {  // stage by stage over the ranks; every rank returns the output
    const int last = schedule_.num_stages() - 1;
    const auto dev = rank_devices_[my_rank_];
    ComputeCopies::Scope bound(copies_);
    for (int s = 0; s <= last; ++s) {
      const int r = schedule_.rank_of(s);
      if (r != my_rank_) continue;
      if (s == 0)
        x = config_.precision.cast_input(input.to(dev));
      else if (schedule_.rank_of(s - 1) != my_rank_)
        x = channel_to(schedule_.rank_of(s - 1), /*outgoing=*/false)->receive().tensor;
      for (int64_t b = first_block_[s]; b < first_block_[s + 1]; ++b) x = m.blocks()[b]->forward(x);
      if (s < last && schedule_.rank_of(s + 1) != my_rank_) channel_to(schedule_.rank_of(s + 1), /*outgoing=*/true)->send(x).wait();
    }
    // The output's shape is known on the last rank only: it tells the others first.
    const bool mine = schedule_.rank_of(last) == my_rank_;
    auto shape = torch::zeros({8}, torch::TensorOptions().dtype(torch::kLong).device(dev));
    if (mine) {
      STRATA_CHECK(x.dim() <= 7, name_ << ": an output of " << x.dim() << " dimensions cannot be shared over ranks");
      shape[0] = x.dim();
      for (int64_t k = 0; k < x.dim(); ++k) shape[k + 1] = x.size(k);
    }
    group_->all_reduce(shape).wait();
    shape = shape.cpu();
    std::vector<int64_t> sizes;
    for (int64_t k = 0; k < shape[0].item<int64_t>(); ++k) sizes.push_back(shape[k + 1].item<int64_t>());
    // In the compute dtype, as every strategy's forward returns it.
    const auto dtype = config_.precision.compute;
    auto out = mine ? x.to(dtype).contiguous() : torch::zeros(sizes, torch::TensorOptions().dtype(dtype).device(dev));
    group_->all_reduce(out).wait();
    return out;
  }
  ComputeCopies::Scope bound(copies_);
  x = config_.precision.cast_input(x);
  for (int s = 0; s < schedule_.num_stages(); ++s) {
    x = x.to(device_of_stage(s));
    for (int64_t b = first_block_[s]; b < first_block_[s + 1]; ++b) {
      Swap swap(*this, s, b);
      x = m.blocks()[b]->forward(x);
    }
  }
  return x;
}

bool Pipeline::supports(const PrecisionPolicy&) const { return true; }

void Pipeline::optimizer_step() {
  auto& params = model().parameters();
  torch::NoGradGuard no_grad;
  // fp16: the gradients carry the loss scale; a step with an inf or nan in any of them is skipped.
  bool finite = scaler_.unscale(grads_);
  // Across processes each rank sees only its own parameters' gradients: a step skipped on one rank
  // is skipped on all, and the scale stays the same everywhere.
  if (c10d_ && scaler_.enabled()) finite = distributed::on_every_rank(*group_, finite, rank_devices_[my_rank_]);
  scaler_.update(finite);
  if (!finite)
    for (auto& g : grads_) g = torch::Tensor();
  for (size_t i = 0; i < params.size(); ++i) {
    if (!grads_[i].defined()) continue;
    auto t = params[i].tensor.data();
    optimizer_update(config_.optimizer, t, grads_[i], optimizer_state_[i]);
    grads_[i] = torch::Tensor();
  }
  // Replicas take their home's new values.
  for (auto& stage : replicas_)
    for (auto& r : stage) {
      const auto& home = params[r.param].tensor;
      if (home.device() != r.value.device()) bytes_interconnect_ += home.nbytes();
      r.value.detach().copy_(home.detach());
    }
  for (const auto& d : rank_devices_) device::synchronize(d);
}

double Pipeline::max_replica_drift() {
  auto& params = model().parameters();
  double drift = 0;
  for (auto& stage : replicas_)
    for (auto& r : stage)
      drift = std::max(drift, (r.value.detach().cpu() - params[r.param].tensor.detach().cpu()).abs().max().item<double>());
  return drift;
}

// Across processes: each tensor from the rank of its `stage` (rank 0 where none uses it), the same on
// every rank.
NamedTensors Pipeline::gather(const std::vector<models::NamedParameter>& tensors, const std::vector<int64_t>& stage) {
  const auto dev = rank_devices_[my_rank_];
  std::vector<torch::Tensor> parts;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i].tensor;
    const int owner = stage[i] >= 0 ? schedule_.rank_of(static_cast<int>(stage[i])) : 0;
    parts.push_back(owner == my_rank_ ? t.detach().to(dev, torch::kFloat64).reshape(-1)
                                         : torch::zeros({t.numel()}, torch::TensorOptions().dtype(torch::kFloat64).device(dev)));
  }
  NamedTensors out;
  if (parts.empty()) return out;
  auto flat = torch::cat(parts);
  group_->all_reduce(flat).wait();
  flat = flat.cpu();
  int64_t at = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i].tensor;
    out.emplace_back(tensors[i].name, flat.narrow(0, at, t.numel()).to(t.scalar_type()).view(t.sizes()).clone());
    at += t.numel();
  }
  return out;
}

NamedTensors Pipeline::gradients() {
  const auto& params = model().parameters();
  if (c10d_) {  // every parameter's gradient from its home rank (shared ones are equal on every holder)
    std::vector<models::NamedParameter> grads;
    for (size_t i = 0; i < params.size(); ++i) {
      // As the optimizer will see them: without the loss scale (fp16).
      auto g = grads_[i].defined() ? scaler_.unscaled(grads_[i])
                                   : torch::zeros(params[i].tensor.sizes(), params[i].tensor.options());
      grads.push_back({params[i].name, g, params[i].owner_block});
    }
    return gather(grads, home_stage_);
  }
  NamedTensors out;
  for (size_t i = 0; i < params.size(); ++i)
    out.emplace_back(params[i].name, grads_[i].defined() ? scaler_.unscaled(grads_[i]).detach().cpu().clone()
                                                         : torch::zeros(params[i].tensor.sizes()));
  return out;
}

NamedTensors Pipeline::parameters() {
  const auto& params = model().parameters();
  return c10d_ ? gather(params, home_stage_) : host_copies(params);
}

NamedTensors Pipeline::buffers() {
  const auto& buffers = model().buffers();
  return c10d_ ? gather(buffers, buffer_stage_) : host_copies(buffers);
}

NamedTensors Pipeline::training_state() {
  const auto& params = model().parameters();
  for (const auto& d : rank_devices_) device::synchronize(d);
  NamedTensors out;
  for (size_t i = 0; i < params.size(); ++i) {
    // A parameter no stage uses stays with rank 0, as gather() reads it.
    const bool here = home_stage_[i] >= 0 ? local_stage(home_stage_[i]) : my_rank_ == 0;
    if (!here) continue;
    STRATA_CHECK(!grads_[i].defined(), name_ << ": training_state() after optimizer_step, with no gradient accumulated ('"
                                             << params[i].name << "' has one)");
    const auto& name = params[i].name;
    out.emplace_back(name, params[i].tensor.detach().to(torch::kCPU, false, /*copy=*/true));
    append_optimizer_state(out, name, optimizer_state_[i]);
  }
  const auto& buffers = model().buffers();
  for (size_t i = 0; i < buffers.size(); ++i)
    if (buffer_stage_[i] >= 0 ? local_stage(buffer_stage_[i]) : my_rank_ == 0)
      out.emplace_back(buffers[i].name, buffers[i].tensor.detach().to(torch::kCPU, false, true));
  if (my_rank_ == 0) out.emplace_back("loss_scaler", scaler_.state());
  return out;
}

void Pipeline::load_training_state(const NamedTensors& state) {
  auto& params = model().parameters();
  // Everything checked before anything changes: a bad state leaves this strategy as it was.
  const auto index = checked_training_state(name_, params, model().buffers(), state);
  for (size_t i = 0; i < params.size(); ++i)
    STRATA_CHECK(!grads_[i].defined(), name_ << ": load_training_state() after optimizer_step, with no gradient accumulated");
  for (const auto& d : rank_devices_) device::synchronize(d);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& name = params[i].name;
    auto t = params[i].tensor.detach();
    t.copy_(index.whole(name, t.sizes()));
    optimizer_state_[i] = optimizer_state_from(index, name, t.sizes(), t.device());
  }
  for (auto& stage : replicas_)  // replicas take their home's values, as after a step
    for (auto& r : stage) r.value.detach().copy_(params[r.param].tensor.detach());
  load_buffers(model().buffers(), index);
  if (auto sc = index.find("loss_scaler"); sc.defined()) scaler_.restore(sc);
  for (const auto& d : rank_devices_) device::synchronize(d);
}

Stats Pipeline::stats() {
  Stats s;
  s.bytes_h2d = bytes_h2d_;
  s.loss_scale = scaler_.scale();
  s.skipped_steps = scaler_.skipped_steps();
  s.bytes_interconnect = bytes_interconnect_;
  const auto& params = model().parameters();
  for (const auto& d : rank_devices_) {
    auto& mem = s.devices[d.str()];
    const auto alloc = device::allocator_stats(d);
    mem.peak_allocated = alloc.peak_allocated;
    mem.peak_reserved = alloc.peak_reserved;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    auto& mem = s.devices[params[i].tensor.device().str()];
    mem.resident_param_bytes += params[i].tensor.nbytes();
  }
  for (const auto& stage : replicas_)
    for (const auto& r : stage) s.devices[r.value.device().str()].resident_param_bytes += r.value.nbytes();
  for (auto& [name, mem] : s.devices) mem.peak_param_bytes = mem.resident_param_bytes;
  return s;
}

void Pipeline::reset_stats() {
  bytes_h2d_ = bytes_interconnect_ = 0;
  for (const auto& d : rank_devices_) device::reset_peak_stats(d);
}

namespace {
std::unique_ptr<Strategy> make_pipeline(const std::string& name, const std::string& schedule, const StrategyConfig& c) {
  auto options = c.options;
  STRATA_CHECK(!options.count("schedule") || options.at("schedule") == schedule,
               name << ": option schedule='" << options.at("schedule") << "' contradicts the strategy's own ("
                    << schedule << "); pick the strategy of that schedule");
  options["schedule"] = schedule;
  return std::make_unique<Pipeline>(name, c, PipelineOptions::parse(options));
}
}  // namespace

static const OptionDocumenter pipeline_docs(
    {"pipeline_gpipe", "pipeline_1f1b", "pipeline_interleaved", "pipeline_custom", "pipeline_zero_bubble"},
    {{"schedule", "gpipe, 1f1b, interleaved, zb-h1, custom", "set by the strategy's name; another value is an Error"},
     {"schedule_text", "ranks' actions split by '/'", "a hand-written schedule in schedule.h's text form"},
     {"schedule_file", "a path", "the same, read from a file"},
     {"devices", "device list", "one device per rank (none given: the config's devices)"},
     {"ranks", "0..", "ranks on the main device when no devices are given (0: 2, or fewer blocks)"},
     {"virtual_stages", "0..", "stages per rank (0: interleaved takes 2 where the blocks allow, else 1)"},
     {"micro_batches", "0..", "micro-batches per train_step (0: 2 per rank)"},
     {"balance", "blocks per stage, or auto", "how blocks are cut into stages (auto: by parameter bytes)"},
     {"replicate_tied", "0/1", "replicas of shared parameters even where the devices agree (tests the swap)", true},
     {"debug_skip_waits", "0/1", "compute does not wait for its transfers (a deliberate bug)", true},
     {"time_actions", "0/1", "time every action, for the simulator's comparison"}});

STRATA_REGISTER_STRATEGY("pipeline_gpipe", "pipeline parallel, GPipe: every micro-batch's forward, then every backward",
                         [](const StrategyConfig& c) { return make_pipeline("pipeline_gpipe", "gpipe", c); });
STRATA_REGISTER_STRATEGY("pipeline_1f1b", "pipeline parallel, 1F1B: one forward, one backward once the pipe is full",
                         [](const StrategyConfig& c) { return make_pipeline("pipeline_1f1b", "1f1b", c); });
STRATA_REGISTER_STRATEGY("pipeline_interleaved",
                         "pipeline parallel, interleaved 1F1B: virtual_stages stages per device (default 2)",
                         [](const StrategyConfig& c) { return make_pipeline("pipeline_interleaved", "interleaved", c); });
STRATA_REGISTER_STRATEGY_NEEDING(
    "pipeline_custom",
    "pipeline parallel running a hand-written schedule: schedule_file=<path> or schedule_text=<ranks split by '/'>",
    (std::map<std::string, std::string>{{"schedule_text", "F0,F1,B0,B1/F0,B0,F1,B1"}}),
    [](const StrategyConfig& c) { return make_pipeline("pipeline_custom", "custom", c); });
STRATA_REGISTER_STRATEGY("pipeline_zero_bubble",
                         "pipeline parallel, ZB-H1: backward split into input and weight gradients, weights deferred",
                         [](const StrategyConfig& c) { return make_pipeline("pipeline_zero_bubble", "zb-h1", c); });

}  // namespace strata
