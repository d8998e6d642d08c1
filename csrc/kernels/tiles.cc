// Tile planning for the CUDA box copy (host code, built in CPU builds too so it is
// tested everywhere). Per box it picks the widest access the pointers, strides and row
// lengths allow, then cuts the box's items into tiles of about tile_bytes, one per warp.
#include <algorithm>
#include <cstdint>

#include "common/dtype.h"
#include "core/box.h"
#include "kernels/api.h"
#include "kernels/codecs/registry.h"

namespace {

constexpr int64_t kMaxUnit = 16;      // one uint4 per lane access
constexpr int64_t kWarp = 32;         // items per tile are rounded to whole warp passes
constexpr int64_t kAutoTiles = 16384; // ~4 waves of warps on 132 SMs at 32 warps/SM
constexpr int64_t kAutoMinTile = 4 << 10;
constexpr int64_t kAutoMaxTile = 64 << 10;
constexpr int64_t kOneRow = INT64_MAX;  // row_items of a 1-D box's flat tiles
constexpr int64_t kWarpShareBytes = 2 << 10;  // rx_tile_warp_shift's target per warp

int64_t box_elems(const rx_box& b) {
  int64_t n = 1;
  for (int d = 0; d < b.ndim; ++d) n *= b.shape[d];
  return n;
}

// The geometry an RX_TILE_FLAT tile carries (api.h).
struct Flat {
  uint64_t src, dst;
  int64_t row_items, src_pitch, dst_pitch;
};

class TileWriter {
 public:
  TileWriter(rx_tile* out, int64_t cap, int64_t tile_bytes) : out_(out), cap_(cap), tile_bytes_(tile_bytes) {}

  // Items [begin, end) of `unit` bytes (0: cast elements, or codec items, of item_bytes;
  // by default the larger element) of box `box`; flat: the tiles carry this geometry.
  void emit(int32_t box, int unit, int src_size, int dst_size, int64_t begin, int64_t end, int64_t item_bytes = 0,
            const Flat* flat = nullptr) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    if (item_bytes <= 0) item_bytes = unit ? unit : std::max(src_size, dst_size);
    const int64_t per = std::max<int64_t>(1, tile_bytes_ / item_bytes);
    const int64_t k = (n + per - 1) / per;
    // Equal tiles (no runt at the end), whole warp passes where the box is big enough.
    int64_t chunk = (n + k - 1) / k;
    if (n > kWarp) chunk = (chunk + kWarp - 1) / kWarp * kWarp;
    for (int64_t b = begin; b < end; b += chunk) {
      if (count_ < cap_) {
        rx_tile& t = out_[count_];
        t.box = box;
        t.unit = static_cast<uint8_t>(unit);
        t.src_size = static_cast<uint8_t>(src_size);
        t.dst_size = static_cast<uint8_t>(dst_size);
        t.flags = flat ? RX_TILE_FLAT : 0;
        t.begin = b;
        t.end = std::min(end, b + chunk);
        const Flat f = flat ? *flat : Flat{};
        t.src = f.src;
        t.dst = f.dst;
        t.row_items = f.row_items;
        t.src_pitch = f.src_pitch;
        t.dst_pitch = f.dst_pitch;
      }
      ++count_;
    }
  }

  int64_t count() const { return count_; }

 private:
  rx_tile* out_;
  int64_t cap_;
  int64_t tile_bytes_;
  int64_t count_ = 0;
};

// The widest unit (es..16) dividing every item address of a multi-dim box whose
// innermost dim is contiguous on both sides.
int rows_unit(const rx_box& b, int es) {
  const int inner = b.ndim - 1;
  for (int64_t u = kMaxUnit; u > es; u /= 2) {
    bool ok = b.src % u == 0 && b.dst % u == 0 && b.shape[inner] * es % u == 0;
    for (int d = 0; ok && d < inner; ++d)
      ok = b.src_stride[d] * es % u == 0 && b.dst_stride[d] * es % u == 0;
    if (ok) return static_cast<int>(u);
  }
  return es;
}

// Flat geometry of `unit`-byte items over a box of 1 or 2 dims, contiguous innermost.
Flat flat_of(const rx_box& b, int es, int64_t unit) {
  const uint64_t u = static_cast<uint64_t>(unit);
  if (b.ndim == 1) return Flat{b.src / u * u, b.dst / u * u, kOneRow, 0, 0};
  return Flat{b.src / u * u, b.dst / u * u, b.shape[1] * es / unit, b.src_stride[0] * es, b.dst_stride[0] * es};
}

// Appends the tiles of one valid, non-empty same-dtype box.
void plan_copy(const rx_box& b, int32_t index, int64_t count, int es, TileWriter& w) {
  const int inner = b.ndim - 1;
  if (b.src_stride[inner] != 1 || b.dst_stride[inner] != 1) {
    w.emit(index, es, es, es, 0, count);  // strided innermost dim: element accesses
    return;
  }
  if (b.ndim > 1) {
    const int u = rows_unit(b, es);
    const Flat flat = flat_of(b, es, u);
    w.emit(index, u, es, es, 0, count * es / u, 0, b.ndim == 2 ? &flat : nullptr);
    return;
  }
  const Flat elems = flat_of(b, es, es);
  // 1-D contiguous: head elements up to the first aligned address, a body of wide
  // items, tail elements. Needs src and dst equally misaligned modulo the unit.
  int64_t u = kMaxUnit;
  while (u > es && (b.src - b.dst) % static_cast<uint64_t>(u) != 0) u /= 2;
  const uint64_t bytes = static_cast<uint64_t>(count) * es;
  const uint64_t lo = (b.src + u - 1) / u * u, hi = (b.src + bytes) / u * u;
  if (u == es || lo >= hi) {
    w.emit(index, es, es, es, 0, count, 0, &elems);
    return;
  }
  const uint64_t base = b.src / u * u;
  const Flat body = flat_of(b, es, u);
  w.emit(index, es, es, es, 0, static_cast<int64_t>((lo - b.src) / es), 0, &elems);
  w.emit(index, static_cast<int>(u), es, es, static_cast<int64_t>((lo - base) / u),
         static_cast<int64_t>((hi - base) / u), 0, &body);
  w.emit(index, es, es, es, static_cast<int64_t>((hi - b.src) / es), count, 0, &elems);
}

int64_t auto_tile_bytes(const rx_box* boxes, int64_t n) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t es = std::max(rx::dtype_size(boxes[i].src_dtype), rx::dtype_size(boxes[i].dst_dtype));
    total += boxes[i].codec == RX_CODEC_NONE ? box_elems(boxes[i]) * es
                                             : rx::codecs::items(boxes[i]) * rx::codecs::item_bytes(boxes[i]);
  }
  const int64_t t = total / kAutoTiles / 512 * 512;
  return std::min(kAutoMaxTile, std::max(kAutoMinTile, t));
}

}  // namespace

extern "C" int64_t rx_plan_tiles(const rx_box* boxes, int64_t num_boxes, int64_t tile_bytes, rx_tile* tiles,
                                 int64_t max_tiles) {
  for (int64_t i = 0; i < num_boxes; ++i) {
    const rx_box& b = boxes[i];
    if (!rx::codecs::box_ok(b)) return -1;
    // The GPU faults on misaligned element accesses (torch never makes such tensors).
    if (b.src % rx::dtype_size(b.src_dtype) != 0 || b.dst % rx::dtype_size(b.dst_dtype) != 0) return -1;
  }
  if (num_boxes > INT32_MAX) return -1;
  if (tile_bytes <= 0) tile_bytes = auto_tile_bytes(boxes, num_boxes);

  TileWriter w(tiles, tiles ? max_tiles : 0, tile_bytes);
  for (int64_t i = 0; i < num_boxes; ++i) {
    const rx_box& b = boxes[i];
    const int64_t count = box_elems(b);
    if (count == 0) continue;
    const int ss = rx::dtype_size(b.src_dtype), ds = rx::dtype_size(b.dst_dtype);
    const int32_t index = static_cast<int32_t>(i);
    if (b.codec != RX_CODEC_NONE)  // one lane per codec item (an MXFP8 block, or scale byte): never split
      w.emit(index, 0, ss, ds, 0, rx::codecs::items(b), rx::codecs::item_bytes(b));
    else if (b.src_dtype != b.dst_dtype)
      w.emit(index, 0, ss, ds, 0, count);
    else
      plan_copy(b, index, count, ss, w);
  }
  return w.count();
}

extern "C" int32_t rx_tile_warp_shift(const rx_tile* tiles, int64_t num_tiles) {
  int64_t most = 0;
  for (int64_t i = 0; i < num_tiles; ++i) {
    const rx_tile& t = tiles[i];
    const int64_t item = t.unit ? t.unit : std::max(t.src_size, t.dst_size);
    most = std::max(most, (t.end - t.begin) * item);
  }
  int32_t shift = 0;
  while (shift < RX_MAX_WARP_SHIFT && (most >> (shift + 1)) >= kWarpShareBytes) ++shift;
  return shift;
}
