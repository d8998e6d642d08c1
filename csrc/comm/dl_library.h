// A shared library resolved at run time instead of linked (nccl_loader.cc and
// nvshmem_comm.cc say why): the copy already mapped in the process first, else the
// candidates Python passes, else the loader's search for the soname.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace rx {

class DlLibrary {
 public:
  // bind(handle) resolves the caller's entry points from an opened library: "" when all
  // resolve, else why the library is unusable. `probe`, one of them, tells the file in use.
  using Bind = std::function<std::string(void* handle)>;
  DlLibrary(std::string soname, std::string probe, Bind bind);

  // The soname already mapped, else the first of `candidates` that opens and binds.
  // Not thread-safe: the caller holds its own lock around every call.
  bool load(const std::vector<std::string>& candidates);
  // load({}), else the loader's search for the soname; false when nothing usable was found.
  bool open();

  bool loaded() const { return handle_ != nullptr; }
  const std::string& soname() const { return soname_; }
  // The file the entry points resolve to ("" until loaded).
  const std::string& path() const { return path_; }
  // One "\n  name: why" line per library that could not be used.
  const std::string& tried() const { return tried_; }

 private:
  bool try_open(const std::string& name, int flags);

  std::string soname_, probe_;
  Bind bind_;
  void* handle_ = nullptr;
  std::string path_, tried_;
};

}  // namespace rx
