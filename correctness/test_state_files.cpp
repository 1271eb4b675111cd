// Checkpoint files (strategies/state_files.h): a round trip to the bit, the newest complete save
// found, a save cut short leaving the one before whole, and every kind of bad input named. The
// files are the host's: the same tests run under either label.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <set>

#include "correctness/support/errors.h"
#include "correctness/support/generators.h"
#include "correctness/support/test_device.h"
#include "models/check.h"
#include "models/model.h"
#include "strategies/state_files.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// A fresh directory, removed at the end.
struct TempDir {
  TempDir() {
    path = (fs::temp_directory_path() / ("strata-state-" + std::to_string(::getpid()) + "-" +
                                         std::to_string(counter++)))
               .string();
    state_files::remove_tree(path);
  }
  ~TempDir() {
    try {
      state_files::remove_tree(path);
    } catch (const std::exception&) {  // a test that failed to remove it says so itself
    }
  }
  std::string path;
  static inline int counter = 0;
};

std::map<std::string, NamedTensors> some_state() {
  torch::manual_seed(7);
  return {{"rank0.pt",
           {{"0.tokens", torch::randn({64, 32})},
            {"1.qkv.weight/exp_avg", torch::randn({96, 32}).to(torch::kBFloat16)},
            {"step", torch::tensor({12}, torch::kLong)}}},
          {"rank1.pt", {{"2.weight", torch::randn({5})}}}};
}

state_files::Manifest manifest_at(int64_t step) {
  state_files::Manifest m;
  m.model = "gpt(depth=2 width=32 heads=4 vocab=64 seq_len=8 tied=1)";
  m.strategy = "baseline";
  m.world = 2;
  m.step = step;
  return m;
}

TEST(StateFiles, a_round_trip_keeps_every_tensor_to_the_bit_and_the_manifest) {
  TempDir dir;
  const auto files = some_state();
  const auto saved = state_files::save(dir.path, manifest_at(12), files);
  EXPECT_EQ(fs::path(saved).filename(), "step-000000012");
  const auto m = state_files::read_manifest(saved);
  EXPECT_EQ(m.model, manifest_at(12).model);
  EXPECT_EQ(m.strategy, "baseline");
  EXPECT_EQ(m.world, 2);
  EXPECT_EQ(m.step, 12);
  ASSERT_EQ(m.files.size(), 2u);
  EXPECT_EQ(m.dtypes.at("1.qkv.weight/exp_avg"), "BFloat16");
  for (const auto& [file, tensors] : files) {
    const auto loaded = state_files::load_file(saved, m, file);
    ASSERT_EQ(loaded.size(), tensors.size());
    for (const auto& [name, t] : tensors) {
      const auto it = std::find_if(loaded.begin(), loaded.end(), [&](const auto& p) { return p.first == name; });
      ASSERT_NE(it, loaded.end()) << name;
      EXPECT_EQ(it->second.scalar_type(), t.scalar_type()) << name;
      EXPECT_TRUE(torch::equal(it->second, t)) << name;
    }
  }
}

TEST(StateFiles, the_latest_is_the_highest_complete_step_and_a_save_cut_short_leaves_it_whole) {
  TempDir dir;
  EXPECT_EQ(state_files::latest(dir.path), "");
  state_files::save(dir.path, manifest_at(5), some_state());
  const auto ten = state_files::save(dir.path, manifest_at(10), some_state());
  EXPECT_EQ(state_files::latest(dir.path), ten);
  // Step 20's save dies after its first file: step 10 stays the latest, whole.
  state_files::SaveHooks die;
  die.after_file = [](const std::string&) { STRATA_FAIL("killed during the save (injected)"); };
  EXPECT_THROW(state_files::save(dir.path, manifest_at(20), some_state(), die), Error);
  EXPECT_EQ(state_files::latest(dir.path), ten);
  EXPECT_FALSE(fs::exists(fs::path(dir.path) / "step-000000020"));
  const auto m = state_files::read_manifest(ten);
  for (const auto& f : m.files) EXPECT_NO_THROW(state_files::load_file(ten, m, f.name));
  // The next save of step 20 replaces what the cut one left.
  EXPECT_EQ(state_files::latest(dir.path), ten);
  const auto twenty = state_files::save(dir.path, manifest_at(20), some_state());
  EXPECT_EQ(state_files::latest(dir.path), twenty);
  EXPECT_THAT([&] { state_files::save(dir.path, manifest_at(20), some_state()); },
              ThrowsMessage<Error>(HasSubstr("step-000000020 exists already")));
}

TEST(StateFiles, bad_input_is_named) {
  TempDir dir;
  const auto saved = state_files::save(dir.path, manifest_at(3), some_state());
  const auto m = state_files::read_manifest(saved);
  const auto file = (fs::path(saved) / "rank0.pt").string();
  const auto size = fs::file_size(file);
  std::vector<char> bytes(size);
  std::ifstream(file, std::ios::binary).read(bytes.data(), static_cast<std::streamsize>(size));
  auto rewrite = [&](const std::vector<char>& b) {
    std::ofstream(file, std::ios::binary | std::ios::trunc).write(b.data(), static_cast<std::streamsize>(b.size()));
  };
  // A flipped byte: the checksum.
  auto flipped = bytes;
  flipped[size / 2] ^= 0x40;
  rewrite(flipped);
  EXPECT_THAT([&] { state_files::load_file(saved, m, "rank0.pt"); },
              ThrowsMessage<Error>(HasSubstr("'rank0.pt' does not match its checksum")));
  // Truncated.
  rewrite(std::vector<char>(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(size / 2)));
  EXPECT_THAT([&] { state_files::load_file(saved, m, "rank0.pt"); },
              ThrowsMessage<Error>(HasSubstr("'rank0.pt' is " + std::to_string(size / 2) + " bytes, its manifest says " +
                                             std::to_string(size))));
  // Missing.
  fs::remove(file);
  EXPECT_THAT([&] { state_files::load_file(saved, m, "rank0.pt"); },
              ThrowsMessage<Error>(HasSubstr("file 'rank0.pt' is missing")));
  EXPECT_THAT([&] { state_files::load_file(saved, m, "rank7.pt"); },
              ThrowsMessage<Error>(HasSubstr("its manifest lists no file 'rank7.pt'")));
  // A newer format, and no manifest at all.
  auto text = m.to_text();
  text.replace(0, text.find('\n'), "strata checkpoint 99");
  EXPECT_THAT([&] { state_files::Manifest::parse(text, "here"); },
              ThrowsMessage<Error>(HasSubstr("here: format 99 is newer than this strata reads (1)")));
  EXPECT_THAT([&] { state_files::Manifest::parse("strata checkpoint 1\nworld two\n", "here"); },
              ThrowsMessage<Error>(HasSubstr("here: line 2 ('world two') cannot be read")));
  fs::remove(fs::path(saved) / "manifest.txt");
  EXPECT_THAT([&] { state_files::read_manifest(saved); }, ThrowsMessage<Error>(HasSubstr("no manifest.txt")));
  EXPECT_EQ(state_files::latest(dir.path), "") << "a checkpoint without its manifest is not complete";
}

TEST(StateFiles, another_models_tensors_are_named_with_their_shapes) {
  const NamedTensors here = {{"0.tokens", torch::zeros({64, 48})}, {"1.bias", torch::zeros({4})}};
  EXPECT_THAT([&] { state_files::check_matches(here, {{"0.tokens", torch::zeros({64, 32})}, {"1.bias", torch::zeros({4})}}, "load"); },
              ThrowsMessage<Error>(HasSubstr("load: '0.tokens' is [64, 32] in the checkpoint, [64, 48] here")));
  EXPECT_THAT([&] { state_files::check_matches(here, {{"0.tokens", torch::zeros({64, 48})}}, "load"); },
              ThrowsMessage<Error>(HasSubstr("load: '1.bias' is not in the checkpoint")));
  EXPECT_THAT([&] {
    state_files::check_matches(here, {{"0.tokens", torch::zeros({64, 48})}, {"1.bias", torch::zeros({4})}, {"x", torch::zeros({1})}}, "load");
  }, ThrowsMessage<Error>(HasSubstr("the checkpoint has 'x', which this model has not")));
  EXPECT_NO_THROW(state_files::check_matches(here, here, "load"));
}

TEST(StateFiles, remove_tree_removes_a_tree_and_leaves_an_absent_path_alone) {
  TempDir dir;
  fs::create_directories(fs::path(dir.path) / "a" / "b");
  std::ofstream(fs::path(dir.path) / "a" / "b" / "f.pt") << "x";
  std::ofstream(fs::path(dir.path) / "g") << "y";
  fs::create_symlink(fs::temp_directory_path(), fs::path(dir.path) / "a" / "link");  // removed, not followed
  state_files::remove_tree(dir.path);
  EXPECT_FALSE(fs::exists(dir.path));
  EXPECT_TRUE(fs::exists(fs::temp_directory_path()));
  EXPECT_NO_THROW(state_files::remove_tree(dir.path));
}

// A background save: the caller goes on while the files are written (here the writer is held in
// the middle of the save until the caller lets it go), the checkpoint appears whole once it is done,
// and a save that fails rethrows its Error from wait(), leaving the checkpoint before as the latest.
TEST(StateFiles, a_background_save_runs_while_the_caller_goes_on_and_its_error_comes_back) {
  TempDir dir;
  const auto five = state_files::save(dir.path, manifest_at(5), some_state());
  std::promise<void> go;
  auto released = go.get_future().share();
  state_files::SaveHooks held;
  held.after_file = [released](const std::string&) { released.wait(); };
  state_files::BackgroundSave background;
  background.start([&, held] { return state_files::save(dir.path, manifest_at(6), some_state(), held); });
  EXPECT_TRUE(background.running());
  EXPECT_EQ(state_files::latest(dir.path), five);  // the save is under way: not yet the latest
  go.set_value();
  const auto six = background.wait();
  EXPECT_FALSE(background.running());
  EXPECT_EQ(state_files::latest(dir.path), six);
  EXPECT_EQ(state_files::load_all(six).size(), 4u);
  state_files::SaveHooks die;
  die.after_file = [](const std::string&) { STRATA_FAIL("killed during the save (injected)"); };
  background.start([&, die] { return state_files::save(dir.path, manifest_at(7), some_state(), die); });
  EXPECT_THAT([&] { background.wait(); }, ThrowsMessage<Error>(HasSubstr("killed during the save (injected)")));
  EXPECT_EQ(state_files::latest(dir.path), six);
  EXPECT_EQ(background.wait(), "");
}

TEST(StateFiles, crc32_is_zlibs) {
  // zlib.crc32(b"123456789") == 0xCBF43926, the check value of CRC-32/IEEE.
  EXPECT_EQ(state_files::crc32("123456789", 9), 0xCBF43926u);
  // A longer buffer (eight bytes a round, then the tail), whole and in two parts.
  std::string bytes(1003, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 7 + 3) % 256);
  EXPECT_EQ(state_files::crc32(bytes.data(), bytes.size()), 0x25A60A70u);  // Python: zlib.crc32(bytes((i * 7 + 3) % 256 for i in range(1003)))
  EXPECT_EQ(state_files::crc32(bytes.data() + 500, 503, state_files::crc32(bytes.data(), 500)), 0x25A60A70u);
}

// A background save that fails with something other than a std::exception, and that no one
// waits for, is reported as it goes, not a std::terminate from its destructor.
TEST(StateFiles, a_background_save_failing_with_anything_is_reported_when_no_one_waits) {
  testing::internal::CaptureStderr();
  {
    state_files::BackgroundSave background;
    background.start([]() -> std::string { throw 42; });
  }
  EXPECT_THAT(testing::internal::GetCapturedStderr(),
              HasSubstr("a background save failed and no one waited for it: an exception that is not a std::exception"));
}

// A write the system refuses (here: a file-size limit, as a full disk would) is an Error naming
// the file and why, not a crash, and the checkpoint before stays the latest.
TEST(StateFiles, a_refused_write_is_an_error_naming_the_file_and_the_last_checkpoint_stays) {
  TempDir dir;
  const auto five = state_files::save(dir.path, manifest_at(5), some_state());
  std::map<std::string, NamedTensors> big = {{"rank0.pt", {{"w", torch::zeros({1 << 20})}}}};  // 4 MiB
  struct rlimit before;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  const auto xfsz = std::signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead
  struct rlimit limited = before;
  limited.rlim_cur = 1 << 20;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  std::string message;
  try {
    state_files::save(dir.path, manifest_at(6), big);
  } catch (const Error& e) {
    message = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, xfsz);
  EXPECT_THAT(message, HasSubstr("cannot write"));
  EXPECT_THAT(message, HasSubstr("rank0.pt"));
  EXPECT_THAT(message, HasSubstr(std::strerror(EFBIG)));
  EXPECT_EQ(state_files::latest(dir.path), five);
}

// The folded CRC (carry-less multiplication, where the CPU has it) equals the table one for any
// bytes, length, start within a buffer and CRC carried in: lengths around the fold's 64 and 16
// byte steps, and a tail after them.
TEST(StateFiles, crc32_folded_equals_the_tables) {
  const bool ok = rc::check("crc32 == crc32_bytewise", [] {
    const auto size = static_cast<size_t>(*correctness::uniform<int64_t>(0, 1200));
    const auto start = static_cast<size_t>(*correctness::uniform<int64_t>(0, 16));
    const auto bytes = *rc::gen::container<std::string>(start + size, rc::gen::arbitrary<char>());
    const auto carried = *rc::gen::arbitrary<uint32_t>();
    const char* data = bytes.data() + start;
    RC_ASSERT(state_files::crc32(data, size, carried) == state_files::crc32_bytewise(data, size, carried));
  });
  EXPECT_TRUE(ok);
  // Long enough that the folding loop runs many rounds.
  std::string big(1 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 2654435761u) >> 13);
  EXPECT_EQ(state_files::crc32(big.data(), big.size()), state_files::crc32_bytewise(big.data(), big.size()));
}

// PyTorch reads the files: torch.load returns the tensors, and the manifest's sizes and CRC-32
// agree with zlib's (correctness/check_torch_load.py). Skipped where python3 has no torch.
TEST(StateFiles, pytorch_loads_the_files) {
  std::string python;
  for (const char* candidate : {"python3", "/usr/bin/python3"})
    if (std::system((std::string(candidate) + " -c 'import torch' > /dev/null 2>&1").c_str()) == 0) {
      python = candidate;
      break;
    }
  if (python.empty()) GTEST_SKIP() << "no python3 with torch here (Debian: python3-torch; ci/setup.sh installs it)";
  TempDir dir;
  const auto files = some_state();
  const auto saved = state_files::save(dir.path, manifest_at(1), files);
  const auto out = (fs::path(dir.path) / "read.txt").string();
  const auto command = python + " " + STRATA_SOURCE_DIR + "/correctness/check_torch_load.py " + saved + " > " +
                       out + " 2>&1";
  const int rc = std::system(command.c_str());
  std::ifstream in(out);
  const std::string printed((std::istreambuf_iterator<char>(in)), {});
  ASSERT_EQ(rc, 0) << printed;
  for (const auto& [file, tensors] : files)
    for (const auto& [name, t] : tensors) {
      char sum[64];
      std::snprintf(sum, sizeof sum, "%.6f", t.to(torch::kDouble).sum().item<double>());
      EXPECT_THAT(printed, HasSubstr(name + " " + c10::toString(t.scalar_type()) + " "));
      EXPECT_THAT(printed, HasSubstr(std::string(sum))) << name;
    }
}


// A state in pieces (a sharded strategy's ranks) reads back whole or in any range, wherever the
// pieces split it; gaps, overlaps and a size of another model are named.
TEST(StateIndex, pieces_read_back_whole_or_in_any_range_and_gaps_are_named) {
  const auto full = torch::arange(10, torch::kFloat).reshape({2, 5});
  const auto flat = full.reshape({-1});
  StateIndex index;
  index.add({{piece_key("w", 0), flat.narrow(0, 0, 4).clone()}, {"step", torch::tensor({3}, torch::kLong)}});
  index.add({{piece_key("w", 7), flat.narrow(0, 7, 3).clone()}, {piece_key("w", 4), flat.narrow(0, 4, 3).clone()}});
  EXPECT_TRUE(torch::equal(index.whole("w", {2, 5}), full));
  EXPECT_TRUE(torch::equal(index.find("w"), flat));
  EXPECT_EQ(index.find("step").item<int64_t>(), 3);
  EXPECT_FALSE(index.find("nope").defined());
  for (int64_t begin = 0; begin <= 10; ++begin)
    for (int64_t end = begin; end <= 10; ++end)
      EXPECT_TRUE(torch::equal(index.range("w", begin, end), flat.narrow(0, begin, end - begin))) << begin << " " << end;
  EXPECT_EQ(index.names(), (std::vector<std::string>{"step", "w"}));
  EXPECT_THAT([&] { index.whole("w", {2, 6}); }, ThrowsMessage<Error>(HasSubstr("'w' has 10 elements in the state, 12 here")));
  EXPECT_THAT([&] { index.whole("step", {2}); }, ThrowsMessage<Error>(HasSubstr("'step' is [1] in the state, [2] here")));
  StateIndex gap;
  gap.add({{piece_key("w", 0), flat.narrow(0, 0, 4).clone()}, {piece_key("w", 6), flat.narrow(0, 6, 4).clone()}});
  EXPECT_THAT([&] { gap.range("w", 2, 8); }, ThrowsMessage<Error>(HasSubstr("'w' has no element 4 (a missing shard?)")));
  EXPECT_THAT([&] { gap.add({{piece_key("w", 3), flat.narrow(0, 3, 2).clone()}}); },
              ThrowsMessage<Error>(HasSubstr("pieces of 'w' at 0 and 3 overlap")));
  EXPECT_THAT([&] { gap.add({{"w", full}}); }, ThrowsMessage<Error>(HasSubstr("'w' twice")));
  EXPECT_THAT([&] { gap.add({{"v@x", flat}}); }, ThrowsMessage<Error>(HasSubstr("'v@x' is neither a name nor name@offset")));
}

// A checkpoint in pieces over two files (as two ranks save it) consolidates into one whole file
// holding exactly the state, every tensor in its model's shape.
TEST(StateFiles, a_checkpoint_in_pieces_consolidates_into_the_whole_state) {
  StrategyConfig config;
  config.optimizer.kind = OptimizerKind::adamw;
  auto s = Registry::create("baseline", config);
  const auto model = models::preset("gpt-tiny").config;
  s->attach(models::build_model(model, 3));
  s->train_step(models::make_batch(model, 4, 1));
  s->optimizer_step();
  const auto state = s->training_state();
  NamedTensors rank0, rank1;
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : s->parameters()) shapes[p.first] = p.second.sizes().vec();
  for (const auto& [name, t] : state) {
    const auto base = name.substr(0, name.rfind('/'));
    if (!shapes.count(base) || (name.size() > base.size() + 1 && name.substr(base.size()) == "/step")) {
      rank0.emplace_back(name, t);
      continue;
    }
    const auto flat = t.reshape({-1});
    const int64_t half = flat.numel() / 3;  // uneven
    rank0.emplace_back(piece_key(name, 0), flat.narrow(0, 0, half).clone());
    rank1.emplace_back(piece_key(name, half), flat.narrow(0, half, flat.numel() - half).clone());
  }
  TempDir dir, out;
  auto m = manifest_at(1);
  m.model = model.to_string();
  m.layout = "pieces";
  const auto saved = state_files::save(dir.path, m, {{"rank-0.pt", rank0}, {"rank-1.pt", rank1}});
  const auto whole_dir = state_files::consolidate(saved, out.path, shapes);
  const auto manifest = state_files::read_manifest(whole_dir);
  EXPECT_EQ(manifest.world, 1);
  EXPECT_EQ(manifest.layout, "full");
  const auto whole = state_files::load_file(whole_dir, manifest, "state.pt");
  const std::map<std::string, torch::Tensor> got(whole.begin(), whole.end());
  ASSERT_EQ(got.size(), state.size());
  for (const auto& [name, t] : state) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_EQ(got.at(name).sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(got.at(name), t)) << name;
  }
  // A file missing is named, not filled in.
  std::filesystem::remove(std::filesystem::path(saved) / "rank-1.pt");
  EXPECT_THAT([&] { state_files::consolidate(saved, out.path + "-2", shapes); },
              ThrowsMessage<Error>(HasSubstr("file 'rank-1.pt' is missing")));
}

// Resume is exact: k steps, the state saved to files and loaded into a new instance, j more steps,
// equal to the bit to k + j steps without the break; the loss scaler and AdamW's step counts
// (its bias correction) come back too.
std::unique_ptr<Strategy> trained(const std::string& strategy, const std::string& precision, int steps,
                                  int first_batch = 0, const NamedTensors* state = nullptr,
                                  const std::map<std::string, std::string>& options = {},
                                  OptimizerKind optimizer = OptimizerKind::adamw) {
  StrategyConfig config;
  config.device = test::device();
  config.optimizer.kind = optimizer;
  config.optimizer.lr = 1e-2;
  if (optimizer == OptimizerKind::sgd) config.optimizer.momentum = 0.9;
  config.precision = PrecisionPolicy::parse(precision);
  config.options = options;
  auto s = Registry::create(strategy, config);
  const auto model = models::preset("gpt-tiny").config;
  s->attach(models::build_model(model, 3));
  if (state) s->load_training_state(*state);
  for (int i = 0; i < steps; ++i) {
    s->train_step(models::make_batch(model, 4, 100 + first_batch + i));
    s->optimizer_step();
  }
  return s;
}

// The strategies that save their state, each with the options that change where that state lives:
// on the device, in pinned host memory, stepped during backward, a tied matrix's second copy.
struct Saving {
  std::string strategy;
  std::map<std::string, std::string> options;
  std::string label() const {
    std::string out = strategy;
    for (const auto& [k, v] : options) out += " " + k + "=" + v;
    return out;
  }
};
const std::vector<Saving>& saving_strategies() {
  static const std::vector<Saving> all = {
      {"baseline", {}},
      {"baseline_checkpoint", {}},
      {"hook_offload", {}},
      {"hook_offload_overlap", {}},
      {"hook_offload_overlap", {{"tied_early", "1"}}},
      {"hook_offload", {{"resident", "1"}, {"resident_updates", "device"}}},
      {"hook_offload_sync", {}},
      {"sharded", {}},
      {"sharded", {{"reshard_after_forward", "0"}}},
      {"sharded_offload", {}},
      {"pipeline_1f1b", {}},
      {"pipeline_gpipe", {}},
      {"pipeline_interleaved", {}},
      {"pipeline_zero_bubble", {}},
      {"manual_split", {}},
  };
  return all;
}

TEST(Resume, is_exact_through_the_files_for_the_strategies_that_save) {
  for (const auto& s : saving_strategies())
    for (const auto* precision : {"fp32", "bf16"})
      for (auto optimizer : {OptimizerKind::adamw, OptimizerKind::sgd}) {
        if (optimizer == OptimizerKind::sgd && std::string(precision) == "bf16") continue;
        SCOPED_TRACE(s.label() + " " + precision + (optimizer == OptimizerKind::sgd ? " sgd" : " adamw"));
        const auto whole = trained(s.strategy, precision, 5, 0, nullptr, s.options, optimizer)->parameters();
        TempDir dir;
        auto first = trained(s.strategy, precision, 3, 0, nullptr, s.options, optimizer);
        state_files::Manifest m;
        m.strategy = s.strategy;
        m.step = 3;
        const auto saved = state_files::save(dir.path, m, {{"state.pt", first->training_state()}});
        const auto manifest = state_files::read_manifest(saved);
        const auto state = state_files::load_file(saved, manifest, "state.pt");
        const auto resumed = trained(s.strategy, precision, 2, /*first_batch=*/3, &state, s.options, optimizer)->parameters();
        ASSERT_EQ(resumed.size(), whole.size());
        for (size_t i = 0; i < whole.size(); ++i)
          EXPECT_TRUE(torch::equal(resumed[i].second, whole[i].second)) << whole[i].first;
      }
}

// A state is the caller's copy: training on leaves it as it was, so a background save may write it
// while the next steps run (state_files::BackgroundSave).
TEST(Resume, a_state_is_a_copy_that_training_on_leaves_alone) {
  for (const auto& s : saving_strategies()) {
    SCOPED_TRACE(s.label());
    auto strategy = trained(s.strategy, "fp32", 2, 0, nullptr, s.options);
    const auto state = strategy->training_state();
    NamedTensors kept;
    for (const auto& [name, t] : state) kept.emplace_back(name, t.clone());
    const auto model = models::preset("gpt-tiny").config;
    for (int i = 0; i < 2; ++i) {
      strategy->train_step(models::make_batch(model, 4, 100 + 2 + i));
      strategy->optimizer_step();
    }
    strategy->parameters();  // every update in flight has landed
    for (size_t i = 0; i < state.size(); ++i) EXPECT_TRUE(torch::equal(state[i].second, kept[i].second)) << state[i].first;
  }
}

// A state loaded into a strategy that has trained already (its windows, resident blocks and
// optimizer state in place) replaces all of it: the next steps are those of a fresh instance.
TEST(Resume, a_state_loaded_mid_run_replaces_everything_the_strategy_held) {
  for (const auto& s : saving_strategies()) {
    SCOPED_TRACE(s.label());
    const auto state = trained(s.strategy, "fp32", 3, 0, nullptr, s.options)->training_state();
    const auto fresh = trained(s.strategy, "fp32", 2, 3, &state, s.options)->parameters();
    auto busy = trained(s.strategy, "fp32", 4, 50, nullptr, s.options);  // other batches, other values
    busy->load_training_state(state);
    const auto model = models::preset("gpt-tiny").config;
    for (int i = 0; i < 2; ++i) {
      busy->train_step(models::make_batch(model, 4, 100 + 3 + i));
      busy->optimizer_step();
    }
    const auto after = busy->parameters();
    ASSERT_EQ(after.size(), fresh.size());
    for (size_t i = 0; i < fresh.size(); ++i) EXPECT_TRUE(torch::equal(after[i].second, fresh[i].second)) << fresh[i].first;
  }
}

TEST(Resume, a_state_of_another_model_is_named_and_changes_nothing) {
  auto s = trained("baseline", "fp32", 1);
  const auto before = s->parameters();
  auto state = s->training_state();
  auto wrong = state;
  for (auto& [name, t] : wrong)
    if (name == before.front().first) t = torch::zeros({t.size(0) + 1, t.size(1)});
  EXPECT_THAT([&] { s->load_training_state(wrong); },
              ThrowsMessage<Error>(HasSubstr("'" + before.front().first + "' is [")));
  auto extra = trained("baseline", "fp32", 2)->training_state();  // other values: a partial load would show
  extra.emplace_back("9.not_here", torch::zeros({1}));
  EXPECT_THAT([&] { s->load_training_state(extra); },
              ThrowsMessage<Error>(HasSubstr("the state has '9.not_here', which this model has not")));
  const auto after = s->parameters();
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i].second, after[i].second));
}

// Every registered strategy saves its state (each is in the resume properties' list); one of a
// user's own that does not says so by name, rather than saving part of it.
class WithoutState : public Strategy {
 public:
  explicit WithoutState(const StrategyConfig& config) : inner_(Registry::create("baseline", config)) {}
  std::string name() const override { return "without_state"; }
  double train_step(const models::Batch& batch) override { return inner_->train_step(batch); }
  torch::Tensor forward(const torch::Tensor& input) override { return inner_->forward(input); }
  void optimizer_step() override { inner_->optimizer_step(); }
  NamedTensors gradients() override { return inner_->gradients(); }
  NamedTensors parameters() override { return inner_->parameters(); }
  NamedTensors buffers() override { return inner_->buffers(); }
  Stats stats() override { return inner_->stats(); }
  void reset_stats() override { inner_->reset_stats(); }

 protected:
  void attach_model(models::BlockModel model) override { inner_->attach(std::move(model)); }

 private:
  std::unique_ptr<Strategy> inner_;
};

TEST(Resume, every_strategy_saves_and_one_that_does_not_says_so) {
  const std::set<std::string> saving(correctness::saving_strategies().begin(), correctness::saving_strategies().end());
  for (const auto& s : saving_strategies()) EXPECT_TRUE(saving.count(s.strategy)) << s.strategy;
  for (const auto& name : Registry::names()) {
    if (Registry::required_options(name).empty()) {
      EXPECT_TRUE(saving.count(name)) << name << " is not in saving_strategies()";
    }
  }
  StrategyConfig config;
  config.device = test::device();
  WithoutState s(config);
  s.attach(models::build_model(models::preset("gpt-tiny").config, 3));
  EXPECT_THAT([&] { s.training_state(); }, ThrowsMessage<Error>(HasSubstr("without_state: does not save its training state yet")));
  EXPECT_THAT([&] { s.load_training_state({}); }, ThrowsMessage<Error>(HasSubstr("without_state: does not load a training state yet")));
}

}  // namespace
}  // namespace strata
