#pragma once
// Pipeline parallel: the model's blocks cut into p x v contiguous stages, stage s on
// rank s % p (strategies/pipeline/schedule.h), each rank a device of its own (or a device repeated,
// or the CPU) with one worker thread and, on CUDA, one stream. Each train_step splits the batch into
// micro-batches and has every rank run its list of the schedule's actions in order; activations and
// their gradients pass between stages through a transport (here: in-process mailboxes, with an event
// per message so a receiving stream waits only for what it reads). One executor runs every schedule:
// GPipe, 1F1B, interleaved 1F1B and ZB-H1 differ only in their action lists.
//
// Launched as several processes (torchrun, strategies/distributed/launch.py), each process is one
// rank on its own device (cuda:LOCAL_RANK, or the CPU) and runs only its own list: messages to
// another rank go over a c10d channel per direction (strategies/distributed/process_group.h; Gloo
// on the CPU, NCCL on CUDA), sent in the sender's order and received in that same order by a
// thread per incoming channel into the rank's mailbox. A stage that throws sends its error in
// place of every message it still owed, so every rank ends the step with it; the ranks then agree
// on failure before summing the loss and the tied copies' gradients (a parameter used on several
// ranks has a copy on each) over the process group.
//
// A stage keeps each block's own autograd graph from its forward to its backward (no
// recomputation) and takes gradients from it explicitly (strategies/checkpoint.h), so B, I (input
// gradient, sent on at once) and W (weight gradients, later) are the same calls with different
// wanted edges. Micro-batch losses are sums over their targets divided by the whole batch's target
// count, so they add up to the batch's mean for any split, uneven ones included.
//
// A parameter used by stages on different devices (the GPT's tied embedding and head) lives in its
// home stage (its first user) and has a replica on each other device that uses it; a block using
// it runs with the replica's data swapped in under a lock the parameter's other users take too, its
// gradients are summed into the home before the step and the replicas re-synced after it.
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "strategies/checkpoint.h"
#include "strategies/device/device.h"
#include "strategies/distributed/process_group.h"
#include "strategies/pipeline/schedule.h"
#include "strategies/strategy.h"

namespace strata {

struct PipelineOptions {
  std::string schedule = "1f1b";       ///< gpipe | 1f1b | interleaved | zb-h1 | custom
  std::string schedule_text;           ///< custom: the schedule in schedule.h's text form (option schedule_text,
                                       ///< or the contents of the file named by option schedule_file)
  std::vector<std::string> devices;    ///< one per rank; empty: the config's devices, else `ranks` x main device
  int64_t ranks = 0;                   ///< ranks on the main device when no devices are given (0: 2, or fewer blocks)
  int64_t virtual_stages = 0;          ///< stages per rank; 0: 2 for interleaved, else 1
  int64_t micro_batches = 0;           ///< per train_step (the batch must hold this many samples); 0: 2 per
                                       ///< rank, fewer for a smaller batch (a multiple of the ranks when interleaved)
  std::vector<int64_t> balance;        ///< blocks per stage (ranks x virtual_stages entries); empty: by parameter bytes
  bool replicate_tied = false;         ///< replicas of shared parameters even where the devices agree (tests the swap)
  bool debug_skip_waits = false;       ///< a receiver does not wait for the sender's event: a deliberate bug (tests)
  bool time_actions = false;           ///< time every action (events on CUDA), for last_costs() and the simulator

  static PipelineOptions parse(const std::map<std::string, std::string>& options);
  void validate() const;
};

class Pipeline : public Strategy {
 public:
  Pipeline(std::string name, const StrategyConfig& config, PipelineOptions options);

  std::string name() const override { return name_; }
  double train_step(const models::Batch& batch) override;
  torch::Tensor forward(const torch::Tensor& input) override;
  void optimizer_step() override;
  NamedTensors gradients() override;
  NamedTensors parameters() override;
  NamedTensors buffers() override;
  /// This rank's part of the state: the parameters whose home stage runs here (every one in one
  /// process) whole, with their optimizer state, the buffers of its stages, and (rank 0) the loss
  /// scaler. load_training_state() takes any whole state on every rank.
  NamedTensors training_state() override;
  void load_training_state(const NamedTensors& state) override;
  Stats stats() override;
  void reset_stats() override;
  /// Every policy in one process (stages compute on compute copies of their parameters and
  /// replicas, activations travel between them in the compute dtype); fp32 only across processes.
  bool supports(const PrecisionPolicy& policy) const override;
  /// Its micro-batches (1 where the batch cannot hold them: train_step names that).
  int64_t batch_slices(int64_t batch_size) const override;

  /// The schedule of the last train_step (at attach: the one for micro_batches, or 2 per rank).
  const pipeline::Schedule& schedule() const { return schedule_; }
  /// The micro-batches a batch of `batch` samples is split into; an Error names both numbers if
  /// the batch cannot hold them.
  int64_t micro_batches_for(int64_t batch) const;
  /// Blocks per stage as resolved at attach().
  const std::vector<int64_t>& balance() const { return balance_; }
  /// Per stage: the most micro-batches whose forward was done and whose backward (W when split)
  /// was not, in the last train_step: the activations the stage held, counted as graphs kept.
  const std::vector<int>& peak_in_flight() const { return peak_in_flight_; }
  /// True when two or more of this process's ranks run on one device (stages sharing a GPU, each
  /// rank on its own host thread). The device's allocator peak then depends on how far those
  /// threads run ahead of the device, not only on the schedule, so it moves with the host
  /// (bench/notes/pipeline-shared-device-peaks.md; ci/gate.py allows such cells more room).
  bool ranks_share_a_device() const;
  /// With time_actions: each stage's mean time per action kind in the last train_step (ms; every
  /// rank's stages, across processes too). The simulator's input for this schedule's ideal step.
  const pipeline::Costs& last_costs() const { return last_costs_; }
  /// With time_actions: the last step's schedule simulated under last_costs(), no transfer time:
  /// what forward + backward would take if only the measured compute counted.
  double simulated_ms() const;

 protected:
  void attach_model(models::BlockModel model) override;

 private:
  friend class PipelineTestPeer;  // correctness/support/strategy_peers.h
  /// Largest |replica - home| over all replicas of shared parameters (0 while in sync).
  double max_replica_drift();
  struct Replica {
    int64_t param;
    torch::Tensor value;  ///< leaf on the stage's device, the home's values after each step
  };
  struct Run;  // one train_step's state, shared by the rank threads
  class Swap;

  models::BlockModel& model();
  torch::Device device_of_stage(int64_t stage) const;
  void build_schedule(int64_t micro_batches);
  void run_rank(Run& run, int rank);
  void run_action(Run& run, const pipeline::Action& action);

  std::string name_;
  StrategyConfig config_;
  PipelineOptions options_;
  std::optional<models::BlockModel> model_;
  pipeline::Schedule schedule_;
  pipeline::Schedule custom_;  ///< schedule=custom: the parsed, validated text (ranks, stages, micro-batches fixed)
  bool custom() const { return options_.schedule == "custom"; }
  std::vector<torch::Device> rank_devices_;
  /// Each rank's stream, chosen once: cuBLAS caches a workspace for every stream a matmul ran on,
  /// so a fresh stream per step would leave 32 MiB more allocated per step until the pool cycles.
  std::vector<device::Stream> rank_streams_;
  /// Each rank's worker thread (and, across processes, each incoming channel's), for the
  /// strategy's life: a thread keeps its cuBLAS handle, so with the streams above the set of
  /// (handle, stream) workspaces is fixed after the first step.
  std::map<int, std::unique_ptr<device::HostQueue>> workers_;
  int64_t virtual_stages_ = 1;
  std::vector<int64_t> balance_;
  std::vector<int64_t> first_block_;                    ///< stage -> its first block (stages + 1 entries)
  std::vector<std::vector<int64_t>> block_params_;      ///< block -> model().parameters() index per block parameter
  std::vector<int64_t> home_stage_;                     ///< parameter -> stage holding its home copy
  std::vector<std::vector<Replica>> replicas_;          ///< stage -> the replicas it computes with
  std::vector<bool> locked_;                            ///< parameter -> replicated somewhere: users take its lock
  std::vector<std::unique_ptr<std::mutex>> locks_;      ///< parameter -> its lock (replicated ones)
  std::vector<torch::Tensor> grads_;                    ///< parameter -> summed gradient on the home device
  std::vector<OptimizerState> optimizer_state_;
  ComputeCopies copies_;  ///< the parameters and replicas, bound while a step's actions run
  LossScaler scaler_;
  std::vector<int> peak_in_flight_;
  int64_t bytes_h2d_ = 0, bytes_interconnect_ = 0;
  pipeline::Costs last_costs_;
  void record_costs(Run& run);

  // c10d transport: launched as several processes, this process runs rank my_rank_ alone.
  bool c10d_ = false;
  int my_rank_ = 0;
  std::shared_ptr<distributed::Group> group_;
  std::vector<int64_t> buffer_stage_;  ///< buffer -> the stage whose device holds it (-1: none)
  std::map<int, device::Stream> receive_streams_;  ///< peer -> the stream its messages arrive on
  bool local_stage(int64_t stage) const { return !c10d_ || schedule_.rank_of(static_cast<int>(stage)) == my_rank_; }
  std::vector<bool> local_param_;   ///< parameter -> used by a stage of this process (all, in one process)
  std::vector<bool> shared_param_;  ///< parameter -> trained and used on several ranks' processes
  std::vector<std::shared_ptr<distributed::Channel>> outgoing_;  ///< this rank's channels to its neighbours
  std::shared_ptr<distributed::Channel> channel_to(int rank, bool outgoing) const;
  /// What this rank's outgoing channels have sent, ever (their own count).
  int64_t channel_bytes_sent() const;
  /// Adds what this rank sends in an all-reduce of `t` to the interconnect bytes.
  void count_all_reduce(const torch::Tensor& t);
  void send_remote(Run& run, int to_stage, const torch::Tensor& t);
  void fail_remaining(Run& run, size_t from_action);
  void receive_from(Run& run, int peer);
  void finish_remote_step(Run& run);
  NamedTensors gather(const std::vector<models::NamedParameter>& tensors, const std::vector<int64_t>& stage);
};

}  // namespace strata
