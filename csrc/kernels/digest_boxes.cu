// The C API of the verify passes (rx_digest_boxes_cuda, api.h): a dispatch over the
// per-pass instances (digest_boxes.h).
#include <cuda_runtime.h>

#include <stdint.h>

#include "kernels/api.h"
#include "kernels/digest_boxes.h"

extern "C" int32_t rx_digest_boxes_cuda(const rx_box* boxes_dev, const rx_tile* tiles_dev, int64_t num_tiles,
                                        int32_t max_blocks, int32_t warp_shift, void* stream, int32_t pass,
                                        uint64_t* digests_dev) {
  if (num_tiles <= 0) return cudaSuccess;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (pass) {
    case RX_PASS_COPY:
      return rx::launch_digest<RX_PASS_COPY>(boxes_dev, tiles_dev, num_tiles, max_blocks, warp_shift, s, digests_dev);
    case RX_PASS_SRC:
      return rx::launch_digest<RX_PASS_SRC>(boxes_dev, tiles_dev, num_tiles, max_blocks, warp_shift, s, digests_dev);
    case RX_PASS_DST:
      return rx::launch_digest<RX_PASS_DST>(boxes_dev, tiles_dev, num_tiles, max_blocks, warp_shift, s, digests_dev);
    default: return cudaErrorInvalidValue;
  }
}
