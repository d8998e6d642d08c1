// Verify pass P of the box copy over a device-resident table (digest_boxes.cuh), one
// instance per pass: digest_boxes_copy.cu, digest_boxes_src.cu, digest_boxes_dst.cu.
#pragma once

#include <cuda_runtime.h>

#include <stdint.h>

#include "kernels/api.h"

namespace rx {

template <int P>
int32_t launch_digest(const rx_box* boxes, const rx_tile* tiles, int64_t num_tiles, int32_t max_blocks,
                      int32_t warp_shift, cudaStream_t stream, uint64_t* digests);

}  // namespace rx
