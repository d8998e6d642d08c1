// rx::DeviceBoxTable: a box table and its tiles, uploaded once at plan time into device
// memory the caller owns (Python allocates it with torch, so the caching allocator
// owns it), replayed by one kernel launch on every execute. launch() allocates
// nothing and never synchronises.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/check.h"
#include "kernels/api.h"

namespace rx {

class DeviceBoxTable {
 public:
  // tile_bytes <= 0: chosen from the table's total (rx_plan_tiles). flat = false clears
  // RX_TILE_FLAT, so every tile reads its box (the kernel's general path, for A/B runs).
  DeviceBoxTable() : DeviceBoxTable(std::vector<rx_box>{}) {}
  explicit DeviceBoxTable(const std::vector<rx_box>& boxes, int64_t tile_bytes = 0, bool flat = true)
      : num_boxes_(static_cast<int64_t>(boxes.size())) {
    const int64_t n = rx_plan_tiles(boxes.data(), num_boxes_, tile_bytes, nullptr, 0);
    RX_HOST_ASSERT(n >= 0, "box table has a bad box (ndim, extent, dtype pair or alignment)");
    num_tiles_ = n;
    tiles_offset_ = align_up(static_cast<int64_t>(boxes.size() * sizeof(rx_box)));
    blob_.resize(static_cast<size_t>(tiles_offset_ + num_tiles_ * static_cast<int64_t>(sizeof(rx_tile))));
    if (!boxes.empty()) std::memcpy(blob_.data(), boxes.data(), boxes.size() * sizeof(rx_box));
    rx_plan_tiles(boxes.data(), num_boxes_, tile_bytes, tiles_host(), num_tiles_);
    warp_shift_ = rx_tile_warp_shift(tiles_host(), num_tiles_);
    if (!flat)
      for (int64_t i = 0; i < num_tiles_; ++i) {
        rx_tile& t = tiles_host()[i];
        t.flags = static_cast<uint8_t>(t.flags & ~RX_TILE_FLAT);
      }
  }

  int64_t num_boxes() const { return num_boxes_; }
  int64_t num_tiles() const { return num_tiles_; }
  // Bytes of device memory upload() fills: the boxes, then the tiles.
  int64_t bytes_needed() const { return static_cast<int64_t>(blob_.size()); }
  const rx_tile* tiles_host() const { return reinterpret_cast<const rx_tile*>(blob_.data() + tiles_offset_); }
  const rx_box* boxes_host() const { return reinterpret_cast<const rx_box*>(blob_.data()); }

  // Copies the table into `dev` (bytes_needed() bytes, 16-byte aligned) on `stream`.
  // The host copy stays here, so the caller need not wait for the copy.
  void upload(void* dev, cudaStream_t stream) {
    RX_HOST_ASSERT(dev != nullptr || blob_.empty(), "upload: null device pointer");
    RX_HOST_ASSERT(reinterpret_cast<uintptr_t>(dev) % 16 == 0, "upload: device memory must be 16-byte aligned");
    if (!blob_.empty()) RX_CUDA_CHECK(cudaMemcpyAsync(dev, blob_.data(), blob_.size(), cudaMemcpyHostToDevice, stream));
    dev_ = static_cast<char*>(dev);
    uploaded_ = true;
  }

  // log2 of the warps an uncapped launch puts on each tile (rx_tile_warp_shift).
  int32_t warp_shift() const { return warp_shift_; }

  // Copies every box: one kernel launch on `stream`, stream-ordered after upload().
  // max_blocks > 0 caps the grid (rx_copy_boxes_cuda); warp_shift >= 0 overrides the
  // table's (benchmarks).
  void launch(cudaStream_t stream, int32_t max_blocks = 0, int32_t warp_shift = -1) const {
    RX_HOST_ASSERT(uploaded_, "launch before upload");
    if (num_tiles_ == 0) return;
    RX_CUDA_CHECK(rx_copy_boxes_cuda(reinterpret_cast<const rx_box*>(dev_),
                                     reinterpret_cast<const rx_tile*>(dev_ + tiles_offset_), num_tiles_, max_blocks,
                                     warp_shift >= 0 ? warp_shift : warp_shift_, stream));
  }

  // A verify pass (rx_pass) over the boxes: digests_dev holds one zeroed uint64 per box
  // (in box order) that the launch adds into; RX_PASS_COPY also copies. max_blocks and
  // warp_shift as for launch(), except that by default only the copy pass splits tiles:
  // the read passes run beside transfers, where whole tiles per warp measured faster.
  void launch_digest(cudaStream_t stream, int32_t max_blocks, uint64_t* digests_dev, int32_t pass,
                     int32_t warp_shift = -1) const {
    RX_HOST_ASSERT(uploaded_, "launch before upload");
    if (num_tiles_ == 0) return;
    if (warp_shift < 0) warp_shift = pass == RX_PASS_COPY ? warp_shift_ : 0;
    RX_CUDA_CHECK(rx_digest_boxes_cuda(reinterpret_cast<const rx_box*>(dev_),
                                       reinterpret_cast<const rx_tile*>(dev_ + tiles_offset_), num_tiles_, max_blocks,
                                       warp_shift, stream, pass, digests_dev));
  }

  // The same copy on the host, through the kernel's own per-lane code (tests).
  void run_emulated(int32_t warp_shift = -1) const {
    RX_HOST_ASSERT(rx_copy_boxes_emulated(boxes_host(), tiles_host(), num_tiles_,
                                          warp_shift >= 0 ? warp_shift : warp_shift_) == 0,
                   "warp_shift ", warp_shift, " is out of range (0..", RX_MAX_WARP_SHIFT, ")");
  }
  std::vector<uint64_t> run_emulated_digest(int32_t pass, int32_t warp_shift = -1) const {
    std::vector<uint64_t> d(static_cast<size_t>(num_boxes_), 0);
    RX_HOST_ASSERT(rx_digest_boxes_emulated(boxes_host(), tiles_host(), num_tiles_, pass,
                                            warp_shift >= 0 ? warp_shift : warp_shift_, d.data()) == 0,
                   "bad pass ", pass, " or warp_shift ", warp_shift, " (0..", RX_MAX_WARP_SHIFT, ")");
    return d;
  }

 private:
  static int64_t align_up(int64_t x) { return (x + 255) / 256 * 256; }
  rx_tile* tiles_host() { return reinterpret_cast<rx_tile*>(blob_.data() + tiles_offset_); }

  int64_t num_boxes_ = 0, num_tiles_ = 0, tiles_offset_ = 0;
  int32_t warp_shift_ = 0;
  std::vector<char> blob_;  // boxes | pad to 256 | tiles: the device image
  char* dev_ = nullptr;
  bool uploaded_ = false;
};

}  // namespace rx
