// The box kernels' per-lane code (box_lanes.cuh) run on the host over host tables, lane by
// lane (rx_copy_boxes_emulated, rx_digest_boxes_emulated; api.h): the very index math of
// the CUDA kernels, for tests on machines without a GPU.
#include <stdint.h>

#include "kernels/api.h"
#include "kernels/box_lanes.cuh"

namespace rx {
namespace {

template <int P>
void emulate_digest(const rx_box* boxes, const rx_tile* tiles, int64_t num_tiles, int32_t warp_shift,
                    uint64_t* digests) {
  Geom<RX_MAX_DIMS> slot;
  for (int64_t t = 0; t < num_tiles; ++t)
    for (int64_t share = 0; share < (int64_t{1} << warp_shift); ++share) {
      rx_tile part = tiles[t];
      if (!narrow_tile(part, share, warp_shift)) continue;
      for (int lane = 0; lane < kWarp; ++lane) {
        Dg dg{};
        run_general<P>(boxes, part, lane, slot, dg);
        digests[part.box] = digest::add(digests[part.box], dg.acc);
      }
    }
}

}  // namespace
}  // namespace rx

extern "C" int32_t rx_copy_boxes_emulated(const rx_box* boxes, const rx_tile* tiles, int64_t num_tiles,
                                          int32_t warp_shift) {
  if (!rx::warp_shift_ok(num_tiles, warp_shift)) return -1;
  rx::Geom<RX_MAX_DIMS> slot;
  for (int64_t t = 0; t < num_tiles; ++t)
    for (int64_t share = 0; share < (int64_t{1} << warp_shift); ++share) {
      rx_tile part = tiles[t];
      if (!rx::narrow_tile(part, share, warp_shift)) continue;
      for (int lane = 0; lane < rx::kWarp; ++lane) rx::run_lane(boxes, part, lane, slot);
    }
  return 0;
}

extern "C" int32_t rx_digest_boxes_emulated(const rx_box* boxes, const rx_tile* tiles, int64_t num_tiles, int32_t pass,
                                            int32_t warp_shift, uint64_t* digests) {
  if (!rx::warp_shift_ok(num_tiles, warp_shift)) return -1;
  switch (pass) {
    case RX_PASS_COPY: rx::emulate_digest<RX_PASS_COPY>(boxes, tiles, num_tiles, warp_shift, digests); return 0;
    case RX_PASS_SRC: rx::emulate_digest<RX_PASS_SRC>(boxes, tiles, num_tiles, warp_shift, digests); return 0;
    case RX_PASS_DST: rx::emulate_digest<RX_PASS_DST>(boxes, tiles, num_tiles, warp_shift, digests); return 0;
    default: return -1;
  }
}
