#pragma once
// Manual split (seed 000): blocks assigned to a list of devices (stages) by an explicit balance or
// automatically by bytes; the batch starts on the first device, activations cross stage
// boundaries through autograd, the loss is computed on the last device. Model parallel only.
//
// A tied parameter used by blocks of two stages lives in its home stage (its first user) and has a
// replica in the other; the replica's gradient is summed into the home before the optimizer step
// and the replica is re-synced from the home after it. The last block, if it is a linear head, can
// be split by output columns over several devices with a cross-entropy computed across the shards
// (vocabulary-parallel), so a classifier larger than any one device trains.
//
// A block's buffers live on its stage's device. Frozen parameters (requires_grad=false), and their
// replicas, get no gradient and no update.
#include <optional>

#include "strategies/checkpoint.h"
#include "strategies/strategy.h"

namespace strata {

struct ManualSplitOptions {
  std::vector<int64_t> balance;        ///< blocks per stage; empty = automatic
  std::vector<std::string> devices;    ///< stage devices; empty = the config's devices, else `stages` x main device
  int64_t stages = 0;                  ///< stages on the main device when no devices are given (0: 2, or 1 for 1 block)
  std::string weigh = "params";        ///< automatic balance by: params (parameter bytes) | memory (+ grads, optimizer state, activations)
  int64_t activation_batch = 8;        ///< with weigh=memory: the batch size the activation estimate is for
  int64_t classifier_shards = 1;       ///< split the last block (a linear head) by output columns into this many shards
  bool sync_replicas = true;           ///< false skips the tied replicas' gradient sum and re-sync (to show the drift)

  static ManualSplitOptions parse(const std::map<std::string, std::string>& options);
  void validate() const;
};

class ManualSplit : public Strategy {
 public:
  ManualSplit(std::string name, const StrategyConfig& config, ManualSplitOptions options);

  std::string name() const override { return name_; }
  double train_step(const models::Batch& batch) override;
  torch::Tensor forward(const torch::Tensor& input) override;
  void optimizer_step() override;
  NamedTensors gradients() override;
  NamedTensors parameters() override;
  /// The whole state as baseline saves it: a split head's weight and bias (and their moments) are
  /// its shards end to end; replicas are not state (they follow their homes).
  NamedTensors training_state() override;
  void load_training_state(const NamedTensors& state) override;
  NamedTensors buffers() override;
  Stats stats() override;
  void reset_stats() override;
  /// Every policy: compute copies of the parameters, replicas and head shards on their devices,
  /// so activations cross devices in the compute dtype; fp32 masters; loss scaling for fp16.
  bool supports(const PrecisionPolicy&) const override { return true; }

  /// Stage devices and blocks per stage as resolved at attach().
  const std::vector<torch::Device>& stage_devices() const { return devices_; }
  const std::vector<int64_t>& balance() const { return balance_; }
  /// For each block's parameters: the device of the tensor the block computes with.
  std::vector<std::pair<std::string, torch::Device>> placement();

  /// Blocks per stage minimising the heaviest stage (contiguous, none empty).
  static std::vector<int64_t> partition(const std::vector<double>& weights, int64_t stages);

  // Used by the replica-running autograd function.
  struct Replica {
    int64_t param;       ///< index into model().parameters()
    int64_t stage;
    torch::Tensor value; ///< leaf on the stage's device
  };
  models::BlockModel& model();
  std::vector<Replica*> replicas_of_block(int64_t block);
  /// While alive, the block's shared parameters hold their replicas' data (restored on any exit).
  class ReplicaSwap {
   public:
    ReplicaSwap(ManualSplit& split, int64_t block);
    ~ReplicaSwap();
    ReplicaSwap(const ReplicaSwap&) = delete;  // restores once
    ReplicaSwap& operator=(const ReplicaSwap&) = delete;

   private:
    ManualSplit& split_;
    int64_t block_;
    std::vector<torch::Tensor> saved_;
  };
  std::vector<KeptGraph>& kept_graphs() { return kept_; }
  void count_interconnect(int64_t bytes) { bytes_interconnect_ += bytes; }

 protected:
  void attach_model(models::BlockModel model) override;

 private:
  friend class ManualSplitTestPeer;  // correctness/support/strategy_peers.h
  /// Largest |replica - home| over all tied replicas (0 while they are in sync).
  double max_replica_drift();
  /// x on `to`; bytes count as interconnect traffic only between different devices, when they move
  /// (an activation in forward, its gradient in backward).
  torch::Tensor transfer(const torch::Tensor& x, const torch::Device& to);
  torch::Tensor run_blocks(torch::Tensor x, const torch::Tensor& target, torch::Tensor* loss);
  torch::Tensor sharded_logits(const torch::Tensor& features);
  torch::Tensor sharded_loss(const torch::Tensor& features, const torch::Tensor& target);
  bool sharded() const { return !shards_.empty(); }

  std::string name_;
  StrategyConfig config_;
  ManualSplitOptions options_;
  std::optional<models::BlockModel> model_;
  std::vector<torch::Device> devices_;
  std::vector<int64_t> balance_;
  std::vector<int64_t> stage_of_;        ///< block -> stage
  std::vector<int64_t> home_stage_;      ///< parameter -> stage of its home copy
  std::vector<Replica> replicas_;
  std::vector<OptimizerState> optimizer_state_;
  std::vector<KeptGraph> kept_;
  torch::Tensor anchor_;                 ///< requires grad, so replica blocks' outputs always do

  // Column shards of the head: weight rows [lo, hi) (and bias) on a device each.
  struct Shard {
    int64_t lo, hi;
    torch::Device device;
    torch::Tensor weight, bias;
    OptimizerState weight_state, bias_state;
  };
  std::vector<Shard> shards_;
  int64_t head_weight_ = -1, head_bias_ = -1;  ///< parameter indices of the split head

  /// Every tensor the optimizer updates (parameters, replicas, head shards), in one list.
  std::vector<torch::Tensor> trained_tensors();

  ComputeCopies copies_;
  LossScaler scaler_;
  int64_t bytes_h2d_ = 0, bytes_interconnect_ = 0;
};

}  // namespace strata
