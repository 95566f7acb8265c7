#include "hp/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "hp/common/check.h"

namespace hp::model {

struct SafetensorsFile::Mapping {
  void* data = MAP_FAILED;
  size_t size = 0;
  ~Mapping() {
    if (data != MAP_FAILED && size > 0) munmap(data, size);
  }
};

at::ScalarType safetensors_dtype(const std::string& name) {
  static const std::map<std::string, at::ScalarType> kinds{
      {"F32", at::kFloat}, {"F64", at::kDouble}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},  {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},   {"BOOL", at::kBool}};
  auto it = kinds.find(name);
  HP_CHECK(it != kinds.end(), "safetensors: dtype '", name,
           "' is not supported; supported: F32, F64, F16, BF16, I64, I32, I16, I8, U8, BOOL");
  return it->second;
}

std::string safetensors_dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "F32";
    case at::kDouble:
      return "F64";
    case at::kHalf:
      return "F16";
    case at::kBFloat16:
      return "BF16";
    case at::kLong:
      return "I64";
    case at::kInt:
      return "I32";
    default:
      break;
  }
  HP_CHECK(false, "safetensors: cannot write dtype ", c10::toString(dtype));
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  HP_CHECK(fd >= 0, "safetensors: cannot open '", path, "': ", std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  const auto size = static_cast<size_t>(st.st_size);
  map_ = std::make_shared<Mapping>();
  map_->size = size;
  if (size > 0) map_->data = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  HP_CHECK(size >= 8 && map_->data != MAP_FAILED, "safetensors: '", path,
           "' is too short or cannot be mapped (", size, " bytes)");
  const auto* bytes = static_cast<const unsigned char*>(map_->data);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i)
    header_len = (header_len << 8) | bytes[i];
  HP_CHECK(header_len <= size - 8, "safetensors: '", path, "' declares a ", header_len,
           "-byte header but has only ", size - 8, " bytes after the length");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes + 8, bytes + 8 + header_len);
  } catch (const nlohmann::json::exception& e) {
    HP_CHECK(false, "safetensors: '", path, "' has a header that is not JSON: ", e.what());
  }
  const auto data_start = static_cast<int64_t>(8 + header_len);
  const auto data_bytes = static_cast<int64_t>(size) - data_start;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    SafetensorsEntry e;
    e.name = name;
    std::vector<int64_t> off;
    try {
      e.dtype = safetensors_dtype(info.at("dtype").get<std::string>());
      e.shape = info.at("shape").get<std::vector<int64_t>>();
      off = info.at("data_offsets").get<std::vector<int64_t>>();
    } catch (const nlohmann::json::exception& ex) {
      HP_CHECK(false, "safetensors: '", path, "': tensor '", name,
               "' has no valid dtype, shape and data_offsets: ", ex.what());
    }
    // The byte count, bounded by the file's data (no overflow: a dimension too large for the
    // data stops the product; a negative one is refused).
    const auto element = static_cast<int64_t>(c10::elementSize(e.dtype));
    int64_t expect = element;
    for (auto d : e.shape) {
      HP_CHECK(d >= 0, "safetensors: '", path, "': tensor '", name, "' has shape ",
               at::IntArrayRef(e.shape), " with a negative dimension; the file is damaged");
      expect = d == 0 || expect <= data_bytes / d ? expect * d : data_bytes + 1;
    }
    HP_CHECK(off.size() == 2 && off[0] >= 0 && off[1] >= off[0] && off[1] <= data_bytes &&
                 off[1] - off[0] == expect,
             "safetensors: '", path, "': tensor '", name, "' has data_offsets [",
             off.empty() ? -1 : off[0], ", ", off.size() < 2 ? -1 : off[1],
             ") that do not hold its shape x dtype (", expect, " bytes) inside the file's ",
             data_bytes, " data bytes; the file is damaged or truncated");
    offsets_[name] = data_start + off[0];
    entries_[name] = std::move(e);
  }
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  for (const auto& [n, e] : entries_)
    out.push_back(n);
  return out;
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  auto it = entries_.find(name);
  HP_CHECK(it != entries_.end(), "safetensors: '", path_, "' has no tensor '", name, "'");
  return it->second;
}

at::Tensor SafetensorsFile::view(const std::string& name) const {
  const auto& e = entry(name);
  auto* ptr = static_cast<char*>(map_->data) + offsets_.at(name);
  auto keep = map_;
  return at::from_blob(
      ptr, e.shape, [keep](void*) mutable { keep.reset(); }, at::TensorOptions().dtype(e.dtype));
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<SafetensorsEntry> entries)
    : path_(std::move(path)), entries_(std::move(entries)) {
  nlohmann::json header = nlohmann::json::object();
  header["__metadata__"] = {{"format", "pt"}};
  int64_t offset = 0;
  for (const auto& e : entries_) {
    int64_t numel = 1;
    for (auto d : e.shape)
      numel *= d;
    const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(e.dtype));
    header[e.name] = {{"dtype", safetensors_dtype_name(e.dtype)},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0)
    text += ' ';  // the data starts 8-byte aligned
  f_ = std::fopen((path_ + ".tmp").c_str(), "wb");
  HP_CHECK(f_ != nullptr, "safetensors: cannot write '", path_, ".tmp': ", std::strerror(errno));
  unsigned char len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i, n >>= 8)
    len[i] = static_cast<unsigned char>(n & 0xff);
  std::fwrite(len, 1, 8, f_);
  std::fwrite(text.data(), 1, text.size(), f_);
}

SafetensorsWriter::~SafetensorsWriter() {
  if (f_ != nullptr) std::fclose(f_);
}

void SafetensorsWriter::write(const at::Tensor& t) {
  HP_CHECK(next_ < entries_.size(), "safetensors: '", path_, "': more tensors written than the ",
           entries_.size(), " declared");
  const auto& e = entries_[next_++];
  HP_CHECK(t.sizes().vec() == e.shape, "safetensors: '", path_, "': tensor '", e.name,
           "' was declared ", at::IntArrayRef(e.shape), " but written ", t.sizes());
  auto c = t.detach().to(at::kCPU, e.dtype).contiguous();
  const size_t bytes = static_cast<size_t>(c.numel()) * c.element_size();
  HP_CHECK(std::fwrite(c.data_ptr(), 1, bytes, f_) == bytes, "safetensors: writing '", path_,
           ".tmp' failed");
}

void SafetensorsWriter::close() {
  HP_CHECK(next_ == entries_.size(), "safetensors: '", path_, "': ", next_, " of ", entries_.size(),
           " tensors written; write every declared tensor before close()");
  const bool ok = std::fflush(f_) == 0 && std::fclose(f_) == 0;
  f_ = nullptr;
  HP_CHECK(ok, "safetensors: writing '", path_, ".tmp' failed");
  std::filesystem::rename(path_ + ".tmp", path_);
}

}  // namespace hp::model
