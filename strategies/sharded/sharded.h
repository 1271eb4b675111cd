#pragma once
// Sharded data parallel (ZeRO-3 / FSDP style), one process per rank over the c10d group of
// strategies/distributed. Units as in hook_offload — a block's own parameters, or one parameter
// several blocks share — each one flat fp32 buffer padded to a multiple of the world size; rank r
// keeps slice r (its shard) and the optimizer state of that slice only. A block's units are
// all-gathered just before it runs (the next blocks' gathers already in flight) and freed after it
// (or kept to backward: reshard_after_forward=0); backward gathers them again in reverse, recomputes
// the block (or keeps its activations) and reduce-scatters each unit's gradient as soon as its last
// use is done, while the next block's backward runs. Each rank is handed the global batch, runs its
// own slice of it, and weighs its loss by its share of the batch's targets, so the result is the
// whole batch's mean whatever the split.
//
// A unit's reduce-scatter is waited for one block later (when the next block's gradients are
// flushed), so it overlaps that block's backward and its full-size gradient buffer lives only that
// long; on a fresh step it reduces straight into the shard's gradient.
//
// sharded_offload keeps shards, their gradients and the optimizer state in pinned host memory and
// steps the optimizer there (the ZeRO-Offload / FSDP CPUOffloadPolicy arrangement). On CUDA a shard
// is copied to the device on a copy stream just before its gather (overlapping the block computing),
// a reduced gradient goes back on another, and, by default (overlap_optimizer=1), the host updates
// each unit as soon as its gradient has landed, while backward goes on.
//
// Mixed precision (StrategyConfig::precision): shards and optimizer state stay fp32; units are
// gathered in the compute dtype (the transfer dtype, which must equal it here), so the blocks
// compute in it; gradients are summed and reduce-scattered in the reduction dtype and added to the
// fp32 shard gradients. sharded_offload keeps a pinned compute-dtype copy of each shard beside it,
// refreshed by each host update, so the shards go up at half the bytes under bf16. fp16 scales the
// loss; a step with an inf or nan gradient on any rank is skipped on every rank.
#include <optional>

#include "strategies/device/device.h"
#include "strategies/distributed/process_group.h"
#include "strategies/strategy.h"
#include "strategies/windowed.h"

namespace strata {

struct ShardedOptions {
  int64_t prefetch = 1;                ///< blocks whose gathers run ahead of the one computing
  bool recompute = true;               ///< activations=recompute (default) or keep
  bool reshard_after_forward = true;   ///< free gathered units after forward (gather again in backward)
  bool offload = false;                ///< shards, gradients and optimizer state in pinned host memory
  bool overlap_optimizer = false;      ///< offload: update each unit on the host during backward
                                       ///< (default with offload; refuses gradient accumulation)
  bool debug_poison = false;           ///< fill every gathered buffer with NaN first (tests)
  bool debug_skip_waits = false;       ///< compute does not wait for gathers: a deliberate bug (tests)
  int64_t debug_fail_rank = -1;        ///< this rank throws in the second block's forward (fault tests)

  static ShardedOptions parse(const std::map<std::string, std::string>& options);
  void validate() const;
  std::string to_string() const;
};

class Sharded : public Strategy, public WindowedRunner {
 public:
  Sharded(std::string name, const StrategyConfig& config, ShardedOptions options);
  ~Sharded() override;

  std::string name() const override { return name_; }
  double train_step(const models::Batch& batch) override;
  torch::Tensor forward(const torch::Tensor& input) override;
  void optimizer_step() override;
  NamedTensors gradients() override;
  NamedTensors parameters() override;
  NamedTensors buffers() override;
  bool accumulates_gradients() const override { return !options_.overlap_optimizer; }
  bool supports(const PrecisionPolicy& policy) const override;
  void finish_backward() override;
  Stats stats() override;
  void reset_stats() override;

  int rank() const;
  int world_size() const override;
  int64_t batch_slices(int64_t batch_size) const override { return world_size(); }
  /// Gathered parameter bytes on the device now (0 at rest: only shards remain).
  int64_t gathered_bytes() const { return gathered_bytes_; }
  /// This rank's rows [first, second) of a batch of `batch` samples.
  std::pair<int64_t, int64_t> slice_of(int64_t batch) const;

  // WindowedRunner.
  models::BlockModel& model() override;
  void before_compute(int64_t block, bool backward) override;
  void after_compute(int64_t block, bool backward) override;
  void flush_gradients(int64_t block, const std::vector<torch::Tensor>& grads) override;
  bool recompute_block(int64_t block) const override { return options_.recompute; }
  std::vector<KeptGraph>& kept_graphs() override { return kept_; }

 protected:
  void attach_model(models::BlockModel model) override;

 private:
  struct Unit;
  void gather(Unit& unit);
  void release(Unit& unit);
  void hold_window(int64_t block);
  void drop_window(int64_t block);
  void prefetch_from(int64_t block, bool backward);
  /// Waits for the reduce-scatters launched so far and adds each result to its shard's gradient
  /// (offload on CUDA: sends it to the host, where it is added and, with overlap_optimizer, applied).
  void finish_reductions();
  void finish_reduction(Unit& unit);
  /// Everything queued on the host and the copy streams (offload) has run.
  void finish_pending();
  void update_shard(Unit& unit);
  bool offload_to_host() const { return options_.offload && !device_.is_cpu(); }
  /// A full tensor assembled from every rank's slice `part` of `unit` (a shard or its gradient).
  torch::Tensor gather_full(const Unit& unit, const torch::Tensor& part);
  NamedTensors full_tensors(bool grads);
  void count_collective(int64_t bytes, double factor);
  /// Bytes of one element as gathered (the transfer dtype) and as reduced (the reduction dtype).
  int64_t gathered_element() const;
  int64_t reduced_element() const;
  /// What `unit` is gathered from on the device's side: its shard (or pinned travel copy) in the
  /// transfer dtype.
  torch::Tensor travel_source(const Unit& unit) const;

  std::string name_;
  StrategyConfig config_;
  ShardedOptions options_;
  torch::Device device_;                  ///< compute device: cuda:LOCAL_RANK in a launched CUDA run
  std::shared_ptr<distributed::Group> group_;
  std::optional<models::BlockModel> model_;
  std::vector<Unit> units_;
  std::vector<std::vector<int64_t>> windows_;
  std::vector<bool> held_;
  std::vector<std::pair<int64_t, int64_t>> param_slot_;  ///< parameter -> (unit, offset in the flat)
  std::vector<KeptGraph> kept_;
  LossScaler scaler_;
  torch::Tensor anchor_;
  std::vector<int64_t> reducing_;            ///< units whose reduce-scatter is in flight, in launch order
  std::optional<device::Stream> h2d_, d2h_;  ///< offload on CUDA: shards up, gradients down
  std::optional<device::HostQueue> host_;    ///< offload on CUDA: landed gradients added and applied
  bool step_in_flight_ = false;              ///< overlap_optimizer: a train_step awaits optimizer_step
  bool backward_ = false;
  int64_t step_blocks_ = 0;  ///< blocks computed in this forward (debug_fail_rank)
  int64_t gathered_bytes_ = 0, peak_gathered_ = 0, shard_bytes_ = 0;
  int64_t bytes_interconnect_ = 0, bytes_h2d_ = 0, bytes_d2h_ = 0;
  std::atomic<int64_t> host_update_ns_{0};  ///< Stats::host_update_ms (offload: the host optimizer's time)
};

}  // namespace strata
