// Finding libnccl at run time (nccl_loader.cc says why it is not linked).
#pragma once

#ifdef RX_WITH_NCCL
#include <nccl.h>

#include <string>
#include <vector>

namespace rx {
// Loads NCCL once: the libnccl.so.2 already in the process, else the first of
// `candidates` (absolute paths) that opens, else the loader's search for the soname.
// Returns the file in use; throws ReshardError listing what was tried.
std::string nccl_load(const std::vector<std::string>& candidates);
bool nccl_loaded();
// The file the NCCL calls resolve to (loads with no candidates first).
std::string nccl_library_path();
}  // namespace rx
#endif
