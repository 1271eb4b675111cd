// strata_checkpoint: what a checkpoint holds, and a sharded one (every rank's pieces) written again
// as one whole state that one process, or PyTorch's torch.load, reads.
//   strata_checkpoint info CHECKPOINT
//   strata_checkpoint consolidate CHECKPOINT OUT_DIR
//   strata_checkpoint bench --dir=DIR [--model=gpt-871m] [--device=cuda:0] [--strategies=A,B]
//                           [--repetitions=3] [--batch=N] [--json=FILE]   (bench/checkpoint_bench.cpp)
// The shapes come from the model the manifest names (a preset's config text), built on the host.
#include <cstdio>
#include <iostream>
#include <string>

#include "models/check.h"
#include "models/model.h"
#include "strategies/state_files.h"

namespace {

int usage() {
  std::fprintf(stderr,
               "usage: strata_checkpoint info CHECKPOINT\n"
               "       strata_checkpoint consolidate CHECKPOINT OUT_DIR\n"
               "       strata_checkpoint bench --dir=DIR [--model=gpt-871m] [--device=cuda:0] [--strategies=A,B]\n"
               "                               [--repetitions=3] [--batch=N] [--json=FILE]\n"
               "  CHECKPOINT is a step directory (DIR/step-000000042) or a directory of them (its latest)\n");
  return 2;
}

std::string resolve(const std::string& path) {
  const auto latest = strata::state_files::latest(path);
  return latest.empty() ? path : latest;
}

}  // namespace

namespace strata::bench {
int checkpoint_bench(int argc, char** argv);
}

int main(int argc, char** argv) {
  using namespace strata;
  if (argc < 3) return usage();
  const std::string command = argv[1];
  try {
    if (command == "bench") return bench::checkpoint_bench(argc, argv);
    const auto checkpoint = resolve(argv[2]);
    const auto manifest = state_files::read_manifest(checkpoint);
    if (command == "info" && argc == 3) {
      std::printf("%s: step %ld of %s, saved by %s at world %d, layout %s, %zu files, %zu tensors\n",
                  checkpoint.c_str(), static_cast<long>(manifest.step), manifest.model.c_str(),
                  manifest.strategy.c_str(), manifest.world, manifest.layout.c_str(), manifest.files.size(),
                  manifest.dtypes.size());
      int64_t bytes = 0;
      for (const auto& f : manifest.files) bytes += f.bytes;
      std::printf("  %.3f GB in files\n", static_cast<double>(bytes) / 1e9);
      return 0;
    }
    if (command == "consolidate" && argc == 4) {
      const auto model = models::build_model(models::ModelConfig::parse(manifest.model), 0);
      std::map<std::string, std::vector<int64_t>> shapes;
      for (const auto& p : model.parameters()) shapes[p.name] = p.tensor.sizes().vec();
      for (const auto& b : model.buffers()) shapes[b.name] = b.tensor.sizes().vec();
      const auto out = state_files::consolidate(checkpoint, argv[3], shapes);
      std::printf("%s: the whole state of step %ld (%s, world %d) in %s/state.pt\n", checkpoint.c_str(),
                  static_cast<long>(manifest.step), manifest.strategy.c_str(), manifest.world, out.c_str());
      return 0;
    }
    return usage();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata_checkpoint: %s\n", e.what());
    return 1;
  }
}
