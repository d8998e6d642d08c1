// CPU twin of the blockwise FP8 codec: its box rows (the reference the CUDA lanes match
// byte for byte, and the data path of the CPU refit), the whole-piece scales and quantize,
// its box checks and Traits record. Same inline math (fp8block.h).
#include <string.h>

#include "common/dtype.h"
#include "kernels/api.h"
#include "kernels/codecs/fp8block.h"
#include "kernels/codecs/fp8block_api.h"
#include "kernels/cpu_twin.h"

namespace rx::fp8b {

namespace {

uint32_t raw_at(const char* p, bool bf16) {
  if (bf16) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
  }
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

// One innermost row of a box: `n` source elements at src (unit stride) into n E4M3 bytes at
// out, each run of kItem under its block's factor.
void row(const rx_box& box, const char* src, uint8_t* out, int64_t n) {
  const bool bf16 = box.src_dtype == RX_BF16;
  const int64_t es = bf16 ? 2 : 4;
  const int32_t scales = box_scales(box);
  const Side& side = *reinterpret_cast<const Side*>(box.param[0]);
  const uint32_t* mult = reinterpret_cast<const uint32_t*>(side.mult);
  const int32_t* rowmap = reinterpret_cast<const int32_t*>(side.rowmap);
  const int32_t* colmap = reinterpret_cast<const int32_t*>(side.colmap);
  const int64_t first = box.param[1] + (src - reinterpret_cast<const char*>(box.src)) / es;
  for (int64_t g = 0; g < n; g += kItem) {
    const int64_t o = first + g;
    const int64_t r = o / box.param[2], c = o % box.param[2];
    const uint32_t m = mult[rowmap[r] + colmap[c]];
    for (int k = 0; k < kItem; ++k)
      out[g + k] = quantize(f32_of_raw(raw_at(src + (g + k) * es, bf16), box.src_dtype), m, scales);
  }
}

}  // namespace

uint64_t cpu_row(const rx_box& box, int32_t pass, const char* src, char* dst, int64_t first, uint64_t k0,
                 int64_t n) {
  (void)first;  // a src codec: the row's place in the piece comes from its source address
  if (pass == RX_PASS_NONE) {
    row(box, src, reinterpret_cast<uint8_t*>(dst), n);
    return 0;
  }
  alignas(16) uint8_t tmp[cpu::kChunk];
  const char* at = dst;
  if (pass == RX_PASS_COPY) {
    row(box, src, reinterpret_cast<uint8_t*>(dst), n);
  } else if (pass == RX_PASS_SRC) {
    row(box, src, tmp, n);
    at = reinterpret_cast<const char*>(tmp);
  }
  return cpu::hash_elems(at, 1, box.dst_dtype, box.digest, k0, n);
}

bool box_valid(const rx_box& b) {
  if (RX_CODEC_ID(b.codec) != RX_CODEC_FP8BLOCK || (b.codec >> 16) != 0) return false;
  const int32_t scales = box_scales(b);
  if (scales != kFp32 && scales != kPow2) return false;
  if (RX_DIGEST_KIND(b.digest) != RX_DIGEST_AS_WRITTEN) return false;
  if (!(b.src_dtype == RX_BF16 || b.src_dtype == RX_F32) || !(b.dst_dtype == RX_F8E4M3 || b.dst_dtype == RX_U8))
    return false;
  const int inner = b.ndim - 1;
  if (b.src_stride[inner] != 1 || b.dst_stride[inner] != 1 || b.shape[inner] % kItem != 0) return false;
  // A Side record, the box inside its piece, each item within one row and one block.
  return b.param[0] != 0 && b.param[1] >= 0 && b.param[2] >= 1 && b.param[1] % b.param[2] % kItem == 0;
}

// An item is kItem elements (never split), reading kItem BF16 (FP32: twice the bytes). The
// planner cuts the data wire's last dim on multiples of kItem.
const codecs::Traits kTraits{RX_CODEC_FP8BLOCK, "fp8block", kItem, kItem, kItem * 2, box_valid, cpu_row, nullptr};

}  // namespace rx::fp8b

namespace fp8b = rx::fp8b;

extern "C" int32_t rx_fp8block_scales_cpu(const uint32_t* amax, int64_t cells, int32_t scales, float* scale_inv,
                                          uint32_t* mult) {
  if (cells < 0 || (scales != RX_FP8B_FP32 && scales != RX_FP8B_POW2)) return -1;
  for (int64_t i = 0; i < cells; ++i) {
    const uint32_t s = fp8b::block_scale_inv(amax[i], scales);
    memcpy(scale_inv + i, &s, 4);
    mult[i] = fp8b::block_mult(amax[i], scales);
  }
  return 0;
}

extern "C" int32_t rx_fp8block_quantize_cpu(const void* src, int32_t dtype, int64_t rows, int64_t cols,
                                            int64_t row_stride, const int32_t* rowmap, const int32_t* colmap,
                                            const uint32_t* mult, int32_t scales, uint8_t* data) {
  if (rows < 0 || cols < 0 || (rows > 1 && row_stride < cols)) return -1;
  if ((dtype != RX_BF16 && dtype != RX_F32) || (scales != RX_FP8B_FP32 && scales != RX_FP8B_POW2)) return -1;
  const bool bf16 = dtype == RX_BF16;
  const int64_t es = bf16 ? 2 : 4;
  for (int64_t r = 0; r < rows; ++r) {
    const char* in = static_cast<const char*>(src) + r * row_stride * es;
    const uint32_t* cells = mult + rowmap[r];
    for (int64_t c = 0; c < cols; ++c)
      data[r * cols + c] = fp8b::quantize(fp8b::f32_of_raw(fp8b::raw_at(in + c * es, bf16), dtype), cells[colmap[c]],
                                          scales);
  }
  return 0;
}
