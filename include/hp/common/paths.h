// Output paths checked before a tool starts its work, so a bad one fails at once and names
// itself instead of being ignored (or failing after the compute). Each check really writes: a
// uniquely named probe file is created in the directory and removed; nothing else is touched.
#pragma once

#include <string>

namespace hp::common {

// Why a file cannot be written at `path` (empty when it can): it is a directory, its directory
// does not exist or is not one, an existing file cannot be opened for writing, or no file can be
// created beside it.
std::string why_file_unwritable(const std::string& path);

// Why `path` cannot serve as an output directory (empty when it can): it is not a directory,
// it cannot be created (it is created when missing), or no file can be created in it.
std::string why_dir_unwritable(const std::string& path);

// Writes `bytes` to `path` (created or truncated) and flushes them to the device (fsync) before
// returning, so that a rename published after it never names a file that a power loss could
// leave short. Throws hp::Error naming `who`, the path and the system's reason.
void write_file_synced(const std::string& path, const std::string& bytes, const std::string& who);

// Flushes the entries of directory `dir` (files created, renamed or removed in it) to the device.
// Throws hp::Error naming `who`, the directory and the system's reason.
void sync_dir(const std::string& dir, const std::string& who);

}  // namespace hp::common
