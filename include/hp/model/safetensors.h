// safetensors files (the Hugging Face weight format): an 8-byte little-endian header length, a
// JSON header {name: {dtype, shape, data_offsets [begin, end)}, "__metadata__": {...}}, then the
// raw little-endian tensor bytes (offsets relative to the end of the header).
//
//   SafetensorsFile f(path);            // memory-mapped, header checked (offsets inside the
//   auto t = f.view("model.norm.weight");   // file, sizes = shape x dtype); a zero-copy view
//   t.narrow(0, a, n).to(at::kFloat);   // only the bytes of the slice are read
//
//   SafetensorsWriter w(path, entries); // the header from every entry's name, dtype, shape
//   w.write(tensor) ...                 // each entry's bytes, in order (streamed)
//   w.close();                          // written to path.tmp, renamed when complete
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace hp::model {

struct SafetensorsEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  bool has(const std::string& name) const { return entries_.count(name) > 0; }
  std::vector<std::string> names() const;
  const SafetensorsEntry& entry(const std::string& name) const;
  // A read-only view of the mapped bytes (never write to it); keeps the mapping alive.
  at::Tensor view(const std::string& name) const;
  const std::string& path() const { return path_; }

 private:
  struct Mapping;
  std::string path_;
  std::shared_ptr<Mapping> map_;
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, int64_t> offsets_;  // absolute byte offset of each tensor
};

class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string path, std::vector<SafetensorsEntry> entries);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  // The next entry's values (its shape; converted to its dtype, contiguous).
  void write(const at::Tensor& t);
  void close();

 private:
  std::string path_;
  std::vector<SafetensorsEntry> entries_;
  size_t next_ = 0;
  std::FILE* f_ = nullptr;
};

// "F32" <-> at::kFloat, "BF16", "F16", "F64", "I64", "I32"; unknown names are an error.
at::ScalarType safetensors_dtype(const std::string& name);
std::string safetensors_dtype_name(at::ScalarType dtype);

}  // namespace hp::model
