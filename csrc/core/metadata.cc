#include "core/metadata.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <unordered_map>

#include "common/check.h"

namespace rx {

namespace {

// Every rank receives world x the largest blob (all_gather_object pads to it), so the
// format is compact: integers as LEB128 varints (signed ones zigzagged: an invalid
// layout must travel as given, to be reported on every rank), each distinct layout once
// per blob, and names sorted and front-coded (the shared prefix with the previous name
// is a length). 45,000 DeepSeek-V3 tensors at 8,192 ranks: 2.5 KB -> under 1 KB a blob.
constexpr uint32_t kMagic = 0x32584c52;  // "RLX2"

uint64_t zigzag(int64_t v) { return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63); }
int64_t unzigzag(uint64_t v) { return static_cast<int64_t>(v >> 1) ^ -static_cast<int64_t>(v & 1); }

class Writer {
 public:
  void u(uint64_t v) {
    while (v >= 0x80) {
      out_.push_back(static_cast<char>(v | 0x80));
      v >>= 7;
    }
    out_.push_back(static_cast<char>(v));
  }
  void s(int64_t v) { u(zigzag(v)); }
  void ints(const std::vector<int64_t>& v) {
    u(v.size());
    for (int64_t x : v) s(x);
  }
  void bytes(const char* p, size_t n) { out_.append(p, n); }
  void raw32(uint32_t v) { out_.append(reinterpret_cast<const char*>(&v), sizeof(v)); }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& s) : p_(s.data()), end_(s.data() + s.size()) {}
  uint64_t u() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      RX_HOST_ASSERT(p_ < end_, "truncated metadata");
      const uint8_t b = static_cast<uint8_t>(*p_++);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    RX_HOST_ASSERT(false, "bad varint in metadata");
    return 0;
  }
  int64_t s() { return unzigzag(u()); }
  // A count of items that each take at least one byte: bounded by what is left.
  size_t count() {
    const uint64_t n = u();
    RX_HOST_ASSERT(n <= static_cast<uint64_t>(end_ - p_), "bad count in metadata");
    return static_cast<size_t>(n);
  }
  std::vector<int64_t> ints() {
    std::vector<int64_t> v(count());
    for (auto& x : v) x = s();
    return v;
  }
  std::string str(size_t n) {
    RX_HOST_ASSERT(n <= static_cast<size_t>(end_ - p_), "truncated metadata");
    std::string out(p_, n);
    p_ += n;
    return out;
  }
  uint32_t raw32() {
    RX_HOST_ASSERT(sizeof(uint32_t) <= static_cast<size_t>(end_ - p_), "truncated metadata");
    uint32_t v;
    std::memcpy(&v, p_, sizeof(v));
    p_ += sizeof(v);
    return v;
  }
  bool done() const { return p_ == end_; }
  const char* pos() const { return p_; }

 private:
  const char* p_;
  const char* end_;
};

// A layout without its mesh: dtype, shape, placements (placement 0: Replicate, else the
// zigzagged shard dim + 1, stride, blocks, sizes).
std::string layout_body(const Layout& l) {
  Writer w;
  w.u(static_cast<uint64_t>(static_cast<uint32_t>(l.dtype())));
  w.ints(l.shape());
  w.u(l.placements().size());
  for (const Placement& p : l.placements()) {
    if (!p.is_shard()) {
      w.u(0);
      continue;
    }
    w.u(zigzag(p.shard_dim) + 1);
    w.s(p.stride);
    w.ints(p.blocks);
    w.ints(p.sizes);
  }
  return w.take();
}

}  // namespace

std::string encode_entries(const std::vector<LayoutEntry>& entries) {
  std::unordered_map<const Mesh*, uint32_t> mesh_ids;
  std::vector<const Mesh*> meshes;
  std::map<std::pair<uint32_t, std::string>, uint32_t> layout_ids;  // (mesh id, body)
  std::vector<const std::pair<const std::pair<uint32_t, std::string>, uint32_t>*> layouts;
  std::vector<size_t> order(entries.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::tie(entries[a].name, entries[a].side) < std::tie(entries[b].name, entries[b].side);
  });
  std::vector<uint32_t> entry_layout(entries.size());
  for (size_t i : order) {
    const Layout& l = *entries[i].layout;
    const uint32_t mesh_id = mesh_ids.emplace(&l.mesh(), static_cast<uint32_t>(meshes.size())).first->second;
    if (mesh_id == meshes.size()) meshes.push_back(&l.mesh());
    auto [it, fresh] = layout_ids.emplace(std::make_pair(mesh_id, layout_body(l)), static_cast<uint32_t>(layouts.size()));
    if (fresh) layouts.push_back(&*it);
    entry_layout[i] = it->second;
  }
  Writer w;
  w.raw32(kMagic);
  w.u(meshes.size());
  for (const Mesh* m : meshes) {
    w.ints(m->shape());
    const auto& ranks = m->ranks();
    w.u(ranks.size());
    // Ranks in arithmetic progression (contiguous blocks, strided EP groups: the common
    // case) travel as (start, step): a 1024-rank mesh costs a few bytes, not 4 KB.
    const int64_t step = ranks.size() > 1 ? static_cast<int64_t>(ranks[1]) - ranks[0] : 1;
    bool progression = !ranks.empty();
    for (size_t i = 1; i < ranks.size() && progression; ++i)
      progression = static_cast<int64_t>(ranks[i]) - ranks[i - 1] == step;
    w.u(progression ? 1 : 0);
    if (progression) {
      w.s(ranks[0]);
      w.s(step);
    } else {
      for (int32_t r : ranks) w.s(r);
    }
  }
  w.u(layouts.size());
  for (const auto* l : layouts) {
    w.u(l->first.first);
    w.bytes(l->first.second.data(), l->first.second.size());
  }
  w.u(entries.size());
  const std::string* prev = nullptr;
  for (size_t i : order) {
    const std::string& name = entries[i].name;
    size_t common = 0;
    if (prev)
      while (common < prev->size() && common < name.size() && (*prev)[common] == name[common]) ++common;
    w.u(common);
    w.u(name.size() - common);
    w.bytes(name.data() + common, name.size() - common);
    w.u(entries[i].side);
    w.u(entry_layout[i]);
    prev = &name;
  }
  return w.take();
}

std::vector<LayoutEntry> decode_entries(const std::vector<std::string>& blobs) {
  // Meshes and layouts interned by content across blobs: 45,000 expert tensors share a
  // few hundred layouts, built once.
  std::map<std::pair<std::vector<int64_t>, std::vector<int32_t>>, std::shared_ptr<const Mesh>> meshes_seen;
  std::map<std::pair<const Mesh*, std::string>, std::shared_ptr<const Layout>> layouts_seen;
  std::vector<LayoutEntry> out;
  for (const std::string& blob : blobs) {
    if (blob.empty()) continue;
    Reader r(blob);
    RX_HOST_ASSERT(r.raw32() == kMagic, "bad metadata blob");
    std::vector<std::shared_ptr<const Mesh>> meshes(r.count());
    for (auto& mesh : meshes) {
      std::vector<int64_t> shape = r.ints();
      const uint64_t n = r.u();
      RX_HOST_ASSERT(n <= (uint64_t{1} << 31), "bad mesh size in metadata");
      std::vector<int32_t> ranks(n);
      if (r.u() == 1) {
        const int64_t start = r.s(), step = r.s();
        for (uint64_t k = 0; k < n; ++k) ranks[k] = static_cast<int32_t>(start + static_cast<int64_t>(k) * step);
      } else {
        for (auto& x : ranks) x = static_cast<int32_t>(r.s());
      }
      auto key = std::make_pair(shape, ranks);
      auto it = meshes_seen.find(key);
      if (it == meshes_seen.end())
        it = meshes_seen.emplace(key, std::make_shared<const Mesh>(std::move(shape), std::move(ranks))).first;
      mesh = it->second;
    }
    std::vector<std::shared_ptr<const Layout>> layouts(r.count());
    for (auto& layout : layouts) {
      const uint64_t mesh_id = r.u();
      RX_HOST_ASSERT(mesh_id < meshes.size(), "bad mesh id in metadata");
      const char* body = r.pos();
      const int32_t dtype = static_cast<int32_t>(static_cast<uint32_t>(r.u()));
      std::vector<int64_t> shape = r.ints();
      std::vector<Placement> placements(r.count());
      for (Placement& p : placements) {
        const uint64_t code = r.u();
        if (code == 0) continue;  // Replicate: the default Placement
        p.shard_dim = static_cast<int32_t>(unzigzag(code - 1));
        p.stride = r.s();
        p.blocks = r.ints();
        p.sizes = r.ints();
      }
      auto key = std::make_pair(meshes[mesh_id].get(), std::string(body, r.pos()));
      auto it = layouts_seen.find(key);
      if (it == layouts_seen.end())
        it = layouts_seen.emplace(std::move(key), std::make_shared<const Layout>(std::move(shape), dtype,
                                                                                  meshes[mesh_id],
                                                                                  std::move(placements))).first;
      layout = it->second;
    }
    const size_t ne = r.count();
    std::string name;
    for (size_t i = 0; i < ne; ++i) {
      const uint64_t common = r.u();
      RX_HOST_ASSERT(common <= name.size(), "bad name prefix in metadata");
      name.resize(common);
      name += r.str(r.count());
      LayoutEntry e;
      e.name = name;
      e.side = static_cast<uint8_t>(r.u());
      const uint64_t layout_id = r.u();
      RX_HOST_ASSERT(layout_id < layouts.size(), "bad layout id in metadata");
      e.layout = layouts[layout_id];
      out.push_back(std::move(e));
    }
    RX_HOST_ASSERT(r.done(), "trailing bytes in metadata");
  }
  return out;
}

}  // namespace rx
