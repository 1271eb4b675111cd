#pragma once
// A training state as Strategy::training_state() returns it and load_training_state() takes it:
// tensors by canonical name, each whole ("3.weight", "3.weight/exp_avg") or, from a sharded
// strategy, in flat pieces ("3.weight@1024": the flattened tensor's elements from 1024 on, as many
// as the piece holds). A StateIndex reads any range of any name from the pieces of one or many
// files, so a state saved at one world size or by one strategy loads at another.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace strata {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// The key of the flat piece of `name` that starts at element `offset`.
std::string piece_key(const std::string& name, int64_t offset);

class StateIndex {
 public:
  /// Adds a state's (or one rank's file's) tensors; a name given twice, or pieces of one name
  /// that overlap, are an Error naming it.
  void add(const NamedTensors& state);
  /// Whether any piece of `name` is here.
  bool has(const std::string& name) const;
  /// The names here, pieces' names without their offsets, sorted.
  std::vector<std::string> names() const;
  /// Elements the pieces of `name` cover, from 0 to the end of the last (gaps are found by range()).
  int64_t extent(const std::string& name) const;
  /// The shape `name` was saved in whole, or empty when it came in pieces.
  std::vector<int64_t> whole_shape(const std::string& name) const;
  /// Elements [begin, end) of `name` flattened, as a new fp32 (or the saved dtype's) host tensor;
  /// an Error names `name` and the first element no piece holds.
  torch::Tensor range(const std::string& name, int64_t begin, int64_t end) const;
  /// All of `name`, shaped `shape`.
  torch::Tensor whole(const std::string& name, at::IntArrayRef shape) const;
  /// All of `name` as saved: in its shape if saved whole, else flat; undefined if absent.
  torch::Tensor find(const std::string& name) const;

 private:
  std::map<std::string, std::map<int64_t, torch::Tensor>> pieces_;  ///< name -> offset -> flat piece
  std::map<std::string, std::vector<int64_t>> shapes_;              ///< names saved whole: their shape
};

}  // namespace strata
