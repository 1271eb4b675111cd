#pragma once
// Training-state checkpoints on disk: one directory per save, `DIR/step-<step>/`, holding files of
// name -> tensor (LibTorch's torch::pickle_save of a dict, which Python's torch.load reads) and a
// manifest written last. A save goes into `step-<step>.partial/` and the directory is renamed once
// its manifest is written, so a save cut short (a crash, a dead rank) leaves the checkpoints before
// it whole, and latest() never returns a partial one. Every file's size and CRC-32 are in the
// manifest and checked on load; bad input is an Error naming what is wrong.
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <string>
#include <vector>

#include "strategies/strategy.h"

namespace strata::state_files {

/// The manifest format this strata writes and reads; a newer one is refused.
inline constexpr int kFormat = 1;

struct FileEntry {
  std::string name;  ///< relative to the checkpoint's directory, e.g. "rank0.pt"
  int64_t bytes = 0;
  uint32_t crc32 = 0;
};

struct Manifest {
  int format = kFormat;
  std::string model;      ///< ModelConfig text (or a chain's)
  std::string strategy;   ///< the registered name that saved it
  /// How tensors are split over the files: "full", each whole, once; "pieces", each rank's
  /// elements of a tensor as "name@offset" (training_state.h) in its own file.
  std::string layout = "full";
  int world = 1;
  int64_t step = 0;
  std::vector<FileEntry> files;
  std::map<std::string, std::string> dtypes;  ///< tensor name -> dtype, as saved

  /// Line-oriented text ("strata checkpoint 1", then "key value" lines): easy to read from any
  /// language; parse() names the line it cannot read.
  std::string to_text() const;
  static Manifest parse(const std::string& text, const std::string& where);
};

/// CRC-32 (IEEE, as zlib's crc32) of `size` bytes, continuing from `crc` (a CRC of the bytes
/// before). Folded with carry-less multiplication where the CPU has it, else through tables.
uint32_t crc32(const char* data, size_t size, uint32_t crc = 0);
/// The same CRC, through tables alone (the reference that crc32's faster path is checked against).
uint32_t crc32_bytewise(const char* data, size_t size, uint32_t crc = 0);

struct SaveHooks {
  /// Called after each file is written (its name): tests throw from it to cut a save short.
  std::function<void(const std::string&)> after_file;
};

/// Saves `files` (file name -> tensors, each tensor copied to the host as it is) as the checkpoint
/// of `manifest.step` under `dir` (created if absent) and returns its directory. The manifest's
/// files and dtypes are filled in here. An existing checkpoint of that step is an Error.
std::string save(const std::string& dir, Manifest manifest, const std::map<std::string, NamedTensors>& files,
                 const SaveHooks& hooks = {});

/// The same save by every rank of a group at once, each rank's `tensors` in its own file
/// ("rank-<rank>.pt"): `barrier` returns once every rank has called it (the group's). Rank 0 makes
/// the directory, and writes the manifest and renames the directory once every rank's file is
/// whole. Returns the checkpoint's directory on every rank; `manifest.world` is set to `world`.
std::string save_ranks(const std::string& dir, Manifest manifest, int rank, int world, const NamedTensors& tensors,
                       const std::function<void()>& barrier, const SaveHooks& hooks = {});
/// save_ranks() in its three phases, for a save whose files are written while training goes on:
/// begin_ranks() (collective: rank 0 makes the step's partial directory), write_rank() (this
/// rank's file; no collective, so it may run on a thread of its own, e.g. in a BackgroundSave),
/// finish_ranks() (collective, once every rank's write_rank() has returned: the manifest, then the
/// rename). A rank that dies between them leaves the step partial, and latest() skips it.
void begin_ranks(const std::string& dir, int64_t step, int rank, const std::function<void()>& barrier);
void write_rank(const std::string& dir, int64_t step, int rank, const NamedTensors& tensors, const SaveHooks& hooks = {});
std::string finish_ranks(const std::string& dir, Manifest manifest, int rank, int world, const std::function<void()>& barrier);

/// Work that runs on a thread of its own while training goes on, one at a time: e.g. save() or
/// write_rank() of a state training_state() returned (the caller's copy, which training does not
/// change). start() waits for the work before it (and rethrows its Error); wait() returns the
/// work's result ("" if none was started) or rethrows its Error. The destructor waits too and
/// reports on stderr an Error that no one waited for.
class BackgroundSave {
 public:
  BackgroundSave() = default;
  BackgroundSave(const BackgroundSave&) = delete;
  BackgroundSave& operator=(const BackgroundSave&) = delete;
  ~BackgroundSave();
  void start(std::function<std::string()> work);
  std::string wait();
  bool running() const { return future_.valid(); }

 private:
  std::future<std::string> future_;
};
/// Every file of a checkpoint, read and checked: all ranks' parts of a state, for
/// Strategy::load_training_state on any strategy and world.
NamedTensors load_all(const std::string& checkpoint);

/// A checkpoint of any layout (every rank's pieces, or whole) written again as one whole state:
/// each tensor under its canonical name in one file "state.pt", shaped as `shapes` gives it (a
/// parameter's or buffer's name; its optimizer slots take its shape), anything else as saved;
/// manifest world 1, layout "full", the same step, under `out_dir`. Returns its directory.
std::string consolidate(const std::string& checkpoint, const std::string& out_dir,
                        const std::map<std::string, std::vector<int64_t>>& shapes);

/// Removes `path` and everything under it; nothing if it is absent, an Error naming what could not
/// be removed. Not std::filesystem::remove_all: a PyTorch wheel's libtorch.so carries a copy of it
/// built against an older libstdc++'s path layout, and a program built with a newer g++ can be
/// bound to that copy and crash in it (seen with torch 2.11 and g++ 13).
void remove_tree(const std::string& path);

/// The newest complete checkpoint under `dir` (the highest step with a manifest), or "" if none.
std::string latest(const std::string& dir);

/// The manifest of the checkpoint in `checkpoint` (a directory save() returned).
Manifest read_manifest(const std::string& checkpoint);

/// One file of a checkpoint, its size and checksum checked against the manifest.
NamedTensors load_file(const std::string& checkpoint, const Manifest& manifest, const std::string& file);

/// Every tensor `expected` names is in `loaded` with the same shape (and nothing else is there):
/// else an Error naming the first mismatch, e.g. "'0.tokens' is [64, 32] in the checkpoint, [64, 48]
/// here" — a checkpoint of another model.
void check_matches(const NamedTensors& expected, const NamedTensors& loaded, const std::string& where);

}  // namespace strata::state_files
