// Compact binary metadata for the plan-time exchange: a rank encodes the layouts it
// reports, every rank decodes all of them. Meshes are interned (a 1024-rank mesh shared
// by 50,000 tensors travels once per blob and is built once per process).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/layout.h"

namespace rx {

struct LayoutEntry {
  uint8_t side;  // 0 = src, 1 = dst
  std::string name;
  std::shared_ptr<const Layout> layout;
};

std::string encode_entries(const std::vector<LayoutEntry>& entries);
// Decodes several blobs (one per rank) with one mesh intern table.
std::vector<LayoutEntry> decode_entries(const std::vector<std::string>& blobs);

}  // namespace rx
