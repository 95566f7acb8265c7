#include "hp/common/paths.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "hp/common/check.h"

namespace hp::common {
namespace fs = std::filesystem;
namespace {

// Creates and removes a uniquely named file in `dir`; the error text, empty when it worked.
std::string probe(const fs::path& dir) {
  static std::atomic<int> counter{0};  // unique names for rank threads of one process
  const auto file = dir / str_cat(".hp-probe-", ::getpid(), "-", counter.fetch_add(1));
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return str_cat("cannot create files in '", dir.string(), "': ", std::strerror(errno));
  ::close(fd);
  ::unlink(file.c_str());
  return {};
}

}  // namespace

std::string why_file_unwritable(const std::string& path) {
  const fs::path p(path);
  std::error_code ec;
  if (path.empty()) return "the path is empty";
  if (fs::is_directory(p, ec)) return "it is a directory; give a file path";
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!fs::exists(dir, ec)) return str_cat("its directory '", dir.string(), "' does not exist");
  if (!fs::is_directory(dir, ec)) return str_cat("'", dir.string(), "' is not a directory");
  if (fs::exists(p, ec)) {
    const int fd = ::open(p.c_str(), O_WRONLY);  // no O_TRUNC: the file stays as it is
    if (fd < 0) return std::strerror(errno);
    ::close(fd);
  }
  return probe(dir);
}

std::string why_dir_unwritable(const std::string& path) {
  const fs::path p(path);
  std::error_code ec;
  if (path.empty()) return "the path is empty";
  if (fs::exists(p, ec) && !fs::is_directory(p, ec)) return "it is not a directory";
  fs::create_directories(p, ec);
  if (ec) return "cannot create it: " + ec.message();
  return probe(p);
}

void write_file_synced(const std::string& path, const std::string& bytes, const std::string& who) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  HP_CHECK(fd >= 0, who, ": cannot write '", path, "': ", std::strerror(errno));
  const char* p = bytes.data();
  size_t left = bytes.size();
  int err = 0;
  while (left > 0 && err == 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : EIO;
      break;
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  HP_CHECK(err == 0, who, ": writing '", path, "' failed: ", std::strerror(err),
           " (disk full or read-only?)");
}

void sync_dir(const std::string& dir, const std::string& who) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  HP_CHECK(fd >= 0, who, ": cannot open directory '", dir, "': ", std::strerror(errno));
  const int err = ::fsync(fd) == 0 ? 0 : errno;
  ::close(fd);
  HP_CHECK(err == 0, who, ": flushing directory '", dir, "' failed: ", std::strerror(err));
}

}  // namespace hp::common
