#include "strategies/state_files.h"

#include <fcntl.h>
#include <ftw.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/serialize.h>

#include <cerrno>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstdio>
#include <cstring>

#include <algorithm>
#include <array>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "models/check.h"
#include "strategies/training_state.h"

namespace strata::state_files {
namespace fs = std::filesystem;

namespace {

constexpr const char* kHeader = "strata checkpoint";
constexpr const char* kManifest = "manifest.txt";

std::string step_name(int64_t step) {
  std::ostringstream out;
  out << "step-" << std::setw(9) << std::setfill('0') << step;
  return out.str();
}

std::vector<char> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  STRATA_CHECK(in, "checkpoint: cannot read " << path.string());
  std::vector<char> out(static_cast<size_t>(in.tellg()));
  in.seekg(0);
  in.read(out.data(), static_cast<std::streamsize>(out.size()));
  STRATA_CHECK(in, "checkpoint: cannot read " << path.string());
  return out;
}

// A file mapped read-only, its pages read in at once (MAP_POPULATE): the checksum runs over the
// page cache and each tensor is copied once, from there to its own storage, where reading the
// file into a buffer first cost a second copy and the buffer's first touch.
class MappedFile final : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit MappedFile(const fs::path& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    STRATA_CHECK(fd >= 0, "checkpoint: cannot read " << path.string() << ": " << std::strerror(errno));
    struct stat st;
    const bool stated = ::fstat(fd, &st) == 0;
    const int stat_errno = errno;
    size_ = stated ? static_cast<size_t>(st.st_size) : 0;
    if (stated && size_ > 0) data_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
    const int map_errno = errno;
    ::close(fd);
    STRATA_CHECK(stated, "checkpoint: cannot read " << path.string() << ": " << std::strerror(stat_errno));
    STRATA_CHECK(data_ != MAP_FAILED, "checkpoint: cannot map " << path.string() << ": " << std::strerror(map_errno));
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() override {
    if (data_ != MAP_FAILED && data_ != nullptr) ::munmap(data_, size_);
  }
  const char* data() const { return static_cast<const char*>(data_); }
  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/ = "") const override {
    if (pos >= size_) return 0;
    n = std::min<size_t>(n, size_ - pos);
    std::memcpy(buf, data() + pos, n);
    return n;
  }

 private:
  void* data_ = nullptr;  // nullptr for an empty file
  size_t size_ = 0;
};

// A file written for a checkpoint: small pieces gathered (the zip's headers), large ones written
// straight from the caller's memory, and the whole on the disk (fsync) before close() returns,
// so that a manifest renamed after it never names bytes a power cut could lose.
class DurableFile {
 public:
  explicit DurableFile(const fs::path& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    STRATA_CHECK(fd_ >= 0, "checkpoint: cannot write " << path.string() << ": " << std::strerror(errno));
  }
  DurableFile(const DurableFile&) = delete;
  DurableFile& operator=(const DurableFile&) = delete;
  ~DurableFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  void write(const char* data, size_t n) {
    if (n < kGathered) {
      if (pending_.size() + n > kGathered) flush();
      pending_.insert(pending_.end(), data, data + n);
      return;
    }
    flush();
    write_all(data, n);
  }
  void close() {
    flush();
    STRATA_CHECK(::fsync(fd_) == 0, "checkpoint: cannot write " << path_.string() << " to disk: " << std::strerror(errno));
    const int rc = ::close(fd_);
    fd_ = -1;
    STRATA_CHECK(rc == 0, "checkpoint: cannot write " << path_.string() << ": " << std::strerror(errno));
  }

 private:
  static constexpr size_t kGathered = 1 << 16;
  void flush() {
    write_all(pending_.data(), pending_.size());
    pending_.clear();
  }
  void write_all(const char* data, size_t n) {
    while (n > 0) {
      const auto w = ::write(fd_, data, std::min<size_t>(n, size_t{1} << 30));
      if (w < 0 && errno == EINTR) continue;
      STRATA_CHECK(w > 0, "checkpoint: cannot write " << path_.string() << ": "
                              << (w < 0 ? std::strerror(errno) : "no byte written (a full disk?)"));
      data += w;
      n -= static_cast<size_t>(w);
    }
  }
  fs::path path_;
  int fd_ = -1;
  std::vector<char> pending_;
};

void write_bytes(const fs::path& path, const char* data, size_t size) {
  DurableFile out(path);
  out.write(data, size);
  out.close();
}

// A directory's entries (files created or renamed in it) on the disk.
void sync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  STRATA_CHECK(fd >= 0, "checkpoint: cannot open " << dir.string() << ": " << std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  STRATA_CHECK(rc == 0, "checkpoint: cannot write " << dir.string() << " to disk: " << std::strerror(err));
}

std::string shape_of(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

struct Written {
  int64_t bytes = 0;
  uint32_t crc32 = 0;
};

// `value` written to `path` in the format of torch.save (a zip of "data.pkl" and each tensor's
// storage: what torch::pickle_save makes, except that the pickle carries no type tags), straight
// from the tensors' memory; its size and CRC-32, taken as it is written. A type tag is a call of
// torch.jit._pickle.restore_type_tag, which torch.load refuses by default from PyTorch 2.6 on
// (weights_only=True); a dict of name -> tensor needs none.
Written write_pickle(const fs::path& path, const c10::IValue& value) {
  std::vector<char> pickle;
  torch::jit::Pickler pickler([&](const char* data, size_t n) { pickle.insert(pickle.end(), data, data + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  DurableFile out(path);
  Written w;
  // The first failed write (a full disk, say) is kept and thrown once the writer is done: nothing
  // is thrown through the zip library's C code, and the writer finishes (into nothing) without
  // an error of its own from its destructor.
  std::exception_ptr failed;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) {
      if (failed) return n;
      const auto* bytes = static_cast<const char*>(data);
      try {
        out.write(bytes, n);
      } catch (...) {
        failed = std::current_exception();
        return n;
      }
      w.crc32 = crc32(bytes, n, w.crc32);
      w.bytes += static_cast<int64_t>(n);
      return n;
    });
    // The pickle names each storage by its place in tensorData(): record data/<place>.
    const auto& tensors = pickler.tensorData();
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& storage = tensors[i].storage();
      writer.writeRecord("data/" + std::to_string(i), storage.data(), storage.nbytes());
    }
    writer.writeRecord("data.pkl", pickle.data(), pickle.size());
    writer.writeEndOfFile();
  }
  if (failed) std::rethrow_exception(failed);
  out.close();
  return w;
}

// `tensors` as one file's dict (read by torch.load), each on the host; their dtypes into
// `dtypes`. A name twice, or one with a space (the manifest is space-separated), is an Error.
c10::IValue as_dict(const NamedTensors& tensors, const std::string& file, std::map<std::string, std::string>& dtypes) {
  c10::Dict<std::string, torch::Tensor> dict;
  for (const auto& [key, t] : tensors) {
    STRATA_CHECK(!dict.contains(key), "checkpoint: '" << key << "' twice in file " << file);
    STRATA_CHECK(key.find_first_of(" \n") == std::string::npos, "checkpoint: tensor name '" << key << "' has a space");
    dict.insert(key, t.detach().to(torch::kCPU).contiguous());
    dtypes[key] = c10::toString(t.scalar_type());
  }
  return c10::IValue(dict);
}

// The manifest written last, by rename, then the directory renamed: the save is whole.
void finish(const Manifest& manifest, const fs::path& partial, const fs::path& final_dir);

}  // namespace

namespace {

// The reflected CRC-32 state (not inverted) after `size` more bytes, a byte at a time through
// eight tables (slicing by 8): table k holds the CRC of a byte followed by k zero bytes.
uint32_t crc32_tables(const unsigned char* p, size_t size, uint32_t crc) {
  static const auto tables = [] {
    std::array<std::array<uint32_t, 256>, 8> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
    return t;
  }();
  const auto& t = tables;
  for (; size >= 8; p += 8, size -= 8) {
    const uint32_t lo = crc ^ (p[0] | p[1] << 8 | p[2] << 16 | static_cast<uint32_t>(p[3]) << 24);
    const uint32_t hi = p[4] | p[5] << 8 | p[6] << 16 | static_cast<uint32_t>(p[7]) << 24;
    crc = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^ t[3][hi & 0xFF] ^
          t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
  }
  for (; size > 0; ++p, --size) crc = t[0][(crc ^ *p) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define STRATA_CRC32_FOLDED 1
// The same state after `size` bytes (a multiple of 16, at least 64) by carry-less multiplication:
// four 128-bit lanes folded 64 bytes ahead, then into one, then reduced to 32 bits (Barrett). The
// constants are powers of x modulo the CRC-32 polynomial (bit-reflected), as in Intel's "Fast CRC
// Computation for Generic Polynomials Using PCLMULQDQ". Several times the tables' speed.
inline __m128i load(const unsigned char* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); }

__attribute__((target("pclmul"))) inline __m128i fold(__m128i x, __m128i k) {  // x.lo * k.lo ^ x.hi * k.hi
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

__attribute__((target("pclmul,sse4.1"))) uint32_t crc32_folded(const unsigned char* p, size_t size, uint32_t crc) {
  __m128i x0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(crc)));
  __m128i x1 = load(p + 16), x2 = load(p + 32), x3 = load(p + 48);
  p += 64;
  size -= 64;
  const __m128i by4 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4);  // x^(4*128+32) and x^(4*128-32), mod P
  for (; size >= 64; p += 64, size -= 64) {
    x0 = _mm_xor_si128(fold(x0, by4), load(p));
    x1 = _mm_xor_si128(fold(x1, by4), load(p + 16));
    x2 = _mm_xor_si128(fold(x2, by4), load(p + 32));
    x3 = _mm_xor_si128(fold(x3, by4), load(p + 48));
  }
  const __m128i by1 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);  // x^(128+32) and x^(128-32), mod P
  __m128i x = _mm_xor_si128(fold(x0, by1), x1);
  x = _mm_xor_si128(fold(x, by1), x2);
  x = _mm_xor_si128(fold(x, by1), x3);
  for (; size >= 16; p += 16, size -= 16) x = _mm_xor_si128(fold(x, by1), load(p));
  // 128 bits to 64, then 64 to 32 + 32.
  x = _mm_xor_si128(_mm_clmulepi64_si128(x, by1, 0x10), _mm_srli_si128(x, 8));
  const __m128i low32 = _mm_set_epi32(0, 0, 0, -1);
  const __m128i r5 = _mm_set_epi64x(0, 0x163cd6124);  // x^64 mod P
  x = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x, low32), r5, 0x00), _mm_srli_si128(x, 4));
  // Barrett reduction: low qword P (reflected, with x^32), high qword mu = floor(x^64 / P).
  const __m128i poly_mu = _mm_set_epi64x(0x1f7011641, 0x1db710641);
  __m128i t = _mm_clmulepi64_si128(_mm_and_si128(x, low32), poly_mu, 0x10);
  t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), poly_mu, 0x00);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(x, t), 1));
}

bool cpu_has_clmul() {
  static const bool has = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return has;
}
#endif

}  // namespace

uint32_t crc32(const char* data, size_t size, uint32_t crc) {
  const auto* p = reinterpret_cast<const unsigned char*>(data);
  crc = ~crc;
#ifdef STRATA_CRC32_FOLDED
  if (size >= 64 && cpu_has_clmul()) {
    const size_t folded = size & ~size_t{15};
    crc = crc32_folded(p, folded, crc);
    p += folded;
    size -= folded;
  }
#endif
  return ~crc32_tables(p, size, crc);
}

uint32_t crc32_bytewise(const char* data, size_t size, uint32_t crc) {
  return ~crc32_tables(reinterpret_cast<const unsigned char*>(data), size, ~crc);
}

std::string Manifest::to_text() const {
  std::ostringstream out;
  out << kHeader << " " << format << "\n"
      << "model " << model << "\n"
      << "strategy " << strategy << "\n"
      << "layout " << layout << "\n"
      << "world " << world << "\n"
      << "step " << step << "\n";
  for (const auto& f : files) out << "file " << f.name << " " << f.bytes << " " << std::hex << std::setw(8)
                                  << std::setfill('0') << f.crc32 << std::dec << std::setfill(' ') << "\n";
  for (const auto& [name, dtype] : dtypes) out << "dtype " << name << " " << dtype << "\n";
  return out.str();
}

Manifest Manifest::parse(const std::string& text, const std::string& where) {
  std::istringstream in(text);
  std::string line;
  STRATA_CHECK(std::getline(in, line) && line.rfind(kHeader, 0) == 0,
               where << ": not a strata checkpoint manifest (its first line is '" << line << "')");
  Manifest m;
  try {
    m.format = std::stoi(line.substr(std::string(kHeader).size()));
  } catch (const std::exception&) {
    STRATA_FAIL(where << ": no format number in '" << line << "'");
  }
  STRATA_CHECK(m.format <= kFormat, where << ": format " << m.format << " is newer than this strata reads ("
                                          << kFormat << "); read it with the strata that wrote it");
  int number = 1;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty()) continue;
    const auto space = line.find(' ');
    const auto key = line.substr(0, space), rest = space == std::string::npos ? "" : line.substr(space + 1);
    try {
      if (key == "model") m.model = rest;
      else if (key == "strategy") m.strategy = rest;
      else if (key == "layout") m.layout = rest;
      else if (key == "world") m.world = std::stoi(rest);
      else if (key == "step") m.step = std::stoll(rest);
      else if (key == "file") {
        std::istringstream f(rest);
        FileEntry e;
        std::string crc;
        STRATA_CHECK(f >> e.name >> e.bytes >> crc, "three fields");
        e.crc32 = static_cast<uint32_t>(std::stoul(crc, nullptr, 16));
        m.files.push_back(e);
      } else if (key == "dtype") {
        const auto last = rest.rfind(' ');
        STRATA_CHECK(last != std::string::npos, "two fields");
        m.dtypes[rest.substr(0, last)] = rest.substr(last + 1);
      } else {
        STRATA_FAIL("unknown key");
      }
    } catch (const std::exception&) {
      STRATA_FAIL(where << ": line " << number << " ('" << line << "') cannot be read");
    }
  }
  return m;
}

std::string save(const std::string& dir, Manifest manifest, const std::map<std::string, NamedTensors>& files,
                 const SaveHooks& hooks) {
  STRATA_CHECK(!files.empty(), "checkpoint: nothing to save");
  const fs::path root(dir), final_dir = root / step_name(manifest.step);
  const fs::path partial = root / (step_name(manifest.step) + ".partial");
  STRATA_CHECK(!fs::exists(final_dir), "checkpoint: " << final_dir.string() << " exists already");
  remove_tree(partial.string());  // a save of this step cut short before
  fs::create_directories(partial);
  manifest.files.clear();
  manifest.dtypes.clear();
  for (const auto& [name, tensors] : files) {
    STRATA_CHECK(name.find_first_of("/ \n") == std::string::npos && !name.empty() && name != kManifest,
                 "checkpoint: file name '" << name << "' must be a plain name");
    const auto written = write_pickle(partial / name, as_dict(tensors, name, manifest.dtypes));
    manifest.files.push_back({name, written.bytes, written.crc32});
    if (hooks.after_file) hooks.after_file(name);
  }
  finish(manifest, partial, final_dir);
  return final_dir.string();
}

namespace {
void finish(const Manifest& manifest, const fs::path& partial, const fs::path& final_dir) {
  const auto text = manifest.to_text();
  write_bytes(partial / (std::string(kManifest) + ".tmp"), text.data(), text.size());
  fs::rename(partial / (std::string(kManifest) + ".tmp"), partial / kManifest);
  sync_directory(partial);  // its files' names, the manifest's included
  fs::rename(partial, final_dir);
  sync_directory(final_dir.parent_path());
}
}  // namespace

void begin_ranks(const std::string& dir, int64_t step, int rank, const std::function<void()>& barrier) {
  const fs::path root(dir), final_dir = root / step_name(step);
  const fs::path partial = root / (step_name(step) + ".partial");
  STRATA_CHECK(!fs::exists(final_dir), "checkpoint: " << final_dir.string() << " exists already");
  if (rank == 0) {
    remove_tree(partial.string());  // a save of this step cut short before
    fs::create_directories(partial);
  }
  barrier();
}

void write_rank(const std::string& dir, int64_t step, int rank, const NamedTensors& tensors, const SaveHooks& hooks) {
  const fs::path partial = fs::path(dir) / (step_name(step) + ".partial");
  // This rank's file, then a line of its size, checksum and dtypes beside it for rank 0.
  const std::string name = "rank-" + std::to_string(rank) + ".pt";
  std::map<std::string, std::string> dtypes;
  const auto written = write_pickle(partial / name, as_dict(tensors, name, dtypes));
  std::ostringstream entry;
  for (const auto& [key, dtype] : dtypes) entry << key << " " << dtype << "\n";
  const auto sums = std::to_string(written.bytes) + " " + std::to_string(written.crc32) + "\n" + entry.str();
  write_bytes(partial / (name + ".entry"), sums.data(), sums.size());
  if (hooks.after_file) hooks.after_file(name);
}

std::string finish_ranks(const std::string& dir, Manifest manifest, int rank, int world, const std::function<void()>& barrier) {
  const fs::path root(dir), final_dir = root / step_name(manifest.step);
  const fs::path partial = root / (step_name(manifest.step) + ".partial");
  barrier();
  if (rank == 0) {
    manifest.world = world;
    manifest.layout = "pieces";
    manifest.files.clear();
    manifest.dtypes.clear();
    for (int r = 0; r < world; ++r) {
      const std::string file = "rank-" + std::to_string(r) + ".pt";
      const auto text = read_bytes(partial / (file + ".entry"));
      std::istringstream in(std::string(text.begin(), text.end()));
      FileEntry e{file, 0, 0};
      STRATA_CHECK(in >> e.bytes >> e.crc32, "checkpoint: rank " << r << "'s entry in " << partial.string() << " cannot be read");
      std::string key, dtype;
      while (in >> key >> dtype) manifest.dtypes[key] = dtype;
      manifest.files.push_back(e);
      fs::remove(partial / (file + ".entry"));
    }
    finish(manifest, partial, final_dir);
  }
  barrier();
  return final_dir.string();
}

std::string save_ranks(const std::string& dir, Manifest manifest, int rank, int world, const NamedTensors& tensors,
                       const std::function<void()>& barrier, const SaveHooks& hooks) {
  begin_ranks(dir, manifest.step, rank, barrier);
  write_rank(dir, manifest.step, rank, tensors, hooks);
  return finish_ranks(dir, std::move(manifest), rank, world, barrier);
}

BackgroundSave::~BackgroundSave() {
  if (!future_.valid()) return;
  try {
    future_.get();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "strata: a background save failed and no one waited for it: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "strata: a background save failed and no one waited for it: an exception that is not a std::exception\n");
  }
}

void BackgroundSave::start(std::function<std::string()> work) {
  wait();
  future_ = std::async(std::launch::async, std::move(work));
}

std::string BackgroundSave::wait() {
  if (!future_.valid()) return "";
  auto f = std::move(future_);
  return f.get();
}

NamedTensors load_all(const std::string& checkpoint) {
  const auto manifest = read_manifest(checkpoint);
  NamedTensors out;
  for (const auto& f : manifest.files)
    for (auto& t : load_file(checkpoint, manifest, f.name)) out.push_back(std::move(t));
  return out;
}

std::string consolidate(const std::string& checkpoint, const std::string& out_dir,
                        const std::map<std::string, std::vector<int64_t>>& shapes) {
  auto manifest = read_manifest(checkpoint);
  StateIndex index;
  index.add(load_all(checkpoint));
  NamedTensors whole;
  for (const auto& name : index.names()) {
    const auto slash = name.rfind('/');
    const auto base = slash == std::string::npos ? name : name.substr(0, slash);
    const bool shaped = shapes.count(name) || (slash != std::string::npos && name.substr(slash) != "/step" && shapes.count(base));
    whole.emplace_back(name, shaped ? index.whole(name, shapes.count(name) ? shapes.at(name) : shapes.at(base)) : index.find(name));
  }
  manifest.layout = "full";
  manifest.world = 1;
  return save(out_dir, manifest, {{"state.pt", whole}});
}

namespace {
thread_local std::string g_unremoved;  // what remove_tree's walk could not remove, and why
thread_local int g_unremoved_errno = 0;
}  // namespace

void remove_tree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    STRATA_CHECK(errno == ENOENT, "cannot remove " << path << ": " << std::strerror(errno));
    return;
  }
  // Depth first, links not followed: each directory emptied before it goes.
  g_unremoved.clear();
  const int rc = ::nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, struct FTW*) {
        if (::remove(p) == 0) return 0;
        g_unremoved = p;
        g_unremoved_errno = errno;
        return -1;
      },
      16, FTW_DEPTH | FTW_PHYS);
  if (rc != 0 && g_unremoved.empty()) {
    g_unremoved = path;
    g_unremoved_errno = errno;
  }
  STRATA_CHECK(rc == 0, "cannot remove " << path << ": " << g_unremoved << ": " << std::strerror(g_unremoved_errno));
}

std::string latest(const std::string& dir) {
  if (!fs::is_directory(dir)) return "";
  std::string best;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const auto name = entry.path().filename().string();
    if (name.rfind("step-", 0) != 0 || name.find('.') != std::string::npos) continue;
    if (!fs::exists(entry.path() / kManifest)) continue;
    if (name > best) best = name;  // zero-padded steps: the text order is the steps' order
  }
  return best.empty() ? "" : (fs::path(dir) / best).string();
}

Manifest read_manifest(const std::string& checkpoint) {
  const fs::path path = fs::path(checkpoint) / kManifest;
  STRATA_CHECK(fs::exists(path), "checkpoint " << checkpoint << ": no " << kManifest
                                               << " (a save cut short, or not a strata checkpoint)");
  const auto bytes = read_bytes(path);
  return Manifest::parse(std::string(bytes.begin(), bytes.end()), "checkpoint " + checkpoint);
}

NamedTensors load_file(const std::string& checkpoint, const Manifest& manifest, const std::string& file) {
  const FileEntry* entry = nullptr;
  for (const auto& f : manifest.files)
    if (f.name == file) entry = &f;
  STRATA_CHECK(entry, "checkpoint " << checkpoint << ": its manifest lists no file '" << file << "'");
  const fs::path path = fs::path(checkpoint) / file;
  STRATA_CHECK(fs::exists(path), "checkpoint " << checkpoint << ": file '" << file << "' is missing");
  auto file_bytes = std::make_shared<MappedFile>(path);
  STRATA_CHECK(static_cast<int64_t>(file_bytes->size()) == entry->bytes,
               "checkpoint " << checkpoint << ": '" << file << "' is " << file_bytes->size() << " bytes, its manifest says "
                             << entry->bytes << " (truncated or replaced)");
  const auto crc = crc32(file_bytes->data(), file_bytes->size());
  STRATA_CHECK(crc == entry->crc32, "checkpoint " << checkpoint << ": '" << file << "' does not match its checksum (crc32 "
                                                  << std::hex << crc << ", its manifest says " << entry->crc32 << ")");
  // What torch::pickle_load does with a buffer, here with the mapped file: the "data" archive.
  caffe2::serialize::PyTorchStreamReader reader(file_bytes);
  const auto dict = torch::jit::readArchiveAndTensors("data", "", "", {}, {}, {}, reader).toGenericDict();
  NamedTensors out;
  for (const auto& item : dict) out.emplace_back(item.key().toStringRef(), item.value().toTensor());
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return out;
}

void check_matches(const NamedTensors& expected, const NamedTensors& loaded, const std::string& where) {
  std::map<std::string, const torch::Tensor*> have;
  for (const auto& [name, t] : loaded) have[name] = &t;
  for (const auto& [name, t] : expected) {
    const auto it = have.find(name);
    STRATA_CHECK(it != have.end(), where << ": '" << name << "' is not in the checkpoint (another model?)");
    STRATA_CHECK(it->second->sizes() == t.sizes(), where << ": '" << name << "' is " << shape_of(*it->second)
                                                         << " in the checkpoint, " << shape_of(t)
                                                         << " here (another model?)");
    have.erase(it);
  }
  STRATA_CHECK(have.empty(), where << ": the checkpoint has '" << have.begin()->first << "', which this model has not");
}

}  // namespace strata::state_files
