// Verify pass RX_PASS_SRC of the box copy (digest_boxes.cuh).
#include "kernels/digest_boxes.cuh"

template int32_t rx::launch_digest<RX_PASS_SRC>(const rx_box*, const rx_tile*, int64_t, int32_t, int32_t,
                                                        cudaStream_t, uint64_t*);
