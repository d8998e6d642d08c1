#include "core/metadata.h"

#include <cstring>
#include <map>
#include <unordered_map>

#include "core/check.h"

namespace rx {

namespace {

constexpr uint32_t kMagic = 0x31584c52;  // "RLX1"

class Writer {
 public:
  template <typename T>
  void put(T v) {
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void put_i64s(const std::vector<int64_t>& v) {
    put<uint32_t>(static_cast<uint32_t>(v.size()));
    out_.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
  }
  void put_str(const std::string& s) {
    put<uint32_t>(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(const std::string& s) : p_(s.data()), end_(s.data() + s.size()) {}
  template <typename T>
  T get() {
    RX_HOST_ASSERT(p_ + sizeof(T) <= end_, "truncated metadata");
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::vector<int64_t> get_i64s() {
    const uint32_t n = get<uint32_t>();
    RX_HOST_ASSERT(p_ + n * sizeof(int64_t) <= end_, "truncated metadata");
    std::vector<int64_t> v(n);
    std::memcpy(v.data(), p_, n * sizeof(int64_t));
    p_ += n * sizeof(int64_t);
    return v;
  }
  std::string get_str() {
    const uint32_t n = get<uint32_t>();
    RX_HOST_ASSERT(p_ + n <= end_, "truncated metadata");
    std::string s(p_, n);
    p_ += n;
    return s;
  }
  bool done() const { return p_ == end_; }

 private:
  const char* p_;
  const char* end_;
};

}  // namespace

std::string encode_entries(const std::vector<LayoutEntry>& entries) {
  std::unordered_map<const Mesh*, uint32_t> mesh_ids;
  std::vector<const Mesh*> meshes;
  for (const auto& e : entries) {
    const Mesh* m = &e.layout->mesh();
    if (mesh_ids.emplace(m, static_cast<uint32_t>(meshes.size())).second) meshes.push_back(m);
  }
  Writer w;
  w.put<uint32_t>(kMagic);
  w.put<uint32_t>(static_cast<uint32_t>(meshes.size()));
  for (const Mesh* m : meshes) {
    w.put_i64s(m->shape());
    const auto& ranks = m->ranks();
    w.put<uint32_t>(static_cast<uint32_t>(ranks.size()));
    // Ranks in arithmetic progression (contiguous blocks, strided EP groups: the common
    // case) travel as (start, step): a 1024-rank mesh costs 9 bytes, not 4 KB.
    const int32_t step = ranks.size() > 1 ? ranks[1] - ranks[0] : 1;
    bool progression = !ranks.empty();
    for (size_t i = 1; i < ranks.size() && progression; ++i) progression = ranks[i] - ranks[i - 1] == step;
    w.put<uint8_t>(progression ? 1 : 0);
    if (progression) {
      w.put<int32_t>(ranks[0]);
      w.put<int32_t>(step);
    } else {
      for (int32_t r : ranks) w.put<int32_t>(r);
    }
  }
  w.put<uint32_t>(static_cast<uint32_t>(entries.size()));
  for (const auto& e : entries) {
    const Layout& l = *e.layout;
    w.put<uint8_t>(e.side);
    w.put_str(e.name);
    w.put<int32_t>(l.dtype());
    w.put_i64s(l.shape());
    w.put<uint32_t>(mesh_ids.at(&l.mesh()));
    w.put<uint32_t>(static_cast<uint32_t>(l.placements().size()));
    for (const Placement& p : l.placements()) {
      w.put<int32_t>(p.shard_dim);
      w.put<int64_t>(p.stride);
      w.put_i64s(p.blocks);
    }
  }
  return w.take();
}

std::vector<LayoutEntry> decode_entries(const std::vector<std::string>& blobs) {
  // Intern meshes by content across blobs.
  std::map<std::pair<std::vector<int64_t>, std::vector<int32_t>>, std::shared_ptr<const Mesh>> interned;
  std::vector<LayoutEntry> out;
  for (const std::string& blob : blobs) {
    if (blob.empty()) continue;
    Reader r(blob);
    RX_HOST_ASSERT(r.get<uint32_t>() == kMagic, "bad metadata blob");
    const uint32_t nm = r.get<uint32_t>();
    std::vector<std::shared_ptr<const Mesh>> meshes;
    meshes.reserve(nm);
    for (uint32_t i = 0; i < nm; ++i) {
      std::vector<int64_t> shape = r.get_i64s();
      const uint32_t n = r.get<uint32_t>();
      std::vector<int32_t> ranks(n);
      if (r.get<uint8_t>() == 1) {
        const int32_t start = r.get<int32_t>(), step = r.get<int32_t>();
        for (uint32_t k = 0; k < n; ++k) ranks[k] = start + static_cast<int32_t>(k) * step;
      } else {
        for (uint32_t k = 0; k < n; ++k) ranks[k] = r.get<int32_t>();
      }
      auto key = std::make_pair(shape, ranks);
      auto it = interned.find(key);
      if (it == interned.end())
        it = interned.emplace(key, std::make_shared<const Mesh>(std::move(shape), std::move(ranks))).first;
      meshes.push_back(it->second);
    }
    const uint32_t ne = r.get<uint32_t>();
    for (uint32_t i = 0; i < ne; ++i) {
      LayoutEntry e;
      e.side = r.get<uint8_t>();
      e.name = r.get_str();
      const int32_t dtype = r.get<int32_t>();
      std::vector<int64_t> shape = r.get_i64s();
      const uint32_t mesh_id = r.get<uint32_t>();
      RX_HOST_ASSERT(mesh_id < meshes.size(), "bad mesh id in metadata");
      const uint32_t np = r.get<uint32_t>();
      std::vector<Placement> placements(np);
      for (uint32_t k = 0; k < np; ++k) {
        placements[k].shard_dim = r.get<int32_t>();
        placements[k].stride = r.get<int64_t>();
        placements[k].blocks = r.get_i64s();
      }
      e.layout = std::make_shared<const Layout>(std::move(shape), dtype, meshes[mesh_id], std::move(placements));
      out.push_back(std::move(e));
    }
    RX_HOST_ASSERT(r.done(), "trailing bytes in metadata");
  }
  return out;
}

}  // namespace rx
