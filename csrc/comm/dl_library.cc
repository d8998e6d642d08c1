#include "comm/dl_library.h"

#include <dlfcn.h>

#include <cstring>
#include <utility>

#include "common/check.h"

namespace rx {

DlLibrary::DlLibrary(std::string soname, std::string probe, Bind bind)
    : soname_(std::move(soname)), probe_(std::move(probe)), bind_(std::move(bind)) {}

bool DlLibrary::try_open(const std::string& name, int flags) {
  void* h = dlopen(name.c_str(), flags);
  if (h == nullptr) {
    if ((flags & RTLD_NOLOAD) == 0) {  // not mapped yet is no failure
      const char* err = dlerror();
      tried_ += detail::format("\n  ", name, ": ", err ? err : "cannot open");
    }
    return false;
  }
  const std::string why = bind_(h);
  if (!why.empty()) {
    tried_ += detail::format("\n  ", name, ": ", why);
    return false;
  }
  handle_ = h;
  path_ = name;
  Dl_info info;
  std::memset(&info, 0, sizeof(info));
  void* probe = dlsym(h, probe_.c_str());
  if (probe != nullptr && dladdr(probe, &info) != 0 && info.dli_fname != nullptr) path_ = info.dli_fname;
  return true;
}

bool DlLibrary::load(const std::vector<std::string>& candidates) {
  if (loaded() || try_open(soname_, RTLD_NOW | RTLD_NOLOAD)) return true;
  for (const std::string& c : candidates)
    if (try_open(c, RTLD_NOW | RTLD_LOCAL)) return true;
  return false;
}

bool DlLibrary::open() { return load({}) || try_open(soname_, RTLD_NOW | RTLD_LOCAL); }

}  // namespace rx
