// CPU twin of the NVFP4 codec: its box rows (the reference the CUDA lanes must match byte
// for byte), the whole-piece quantize (the data path of the CPU (gloo) refit), its box
// checks and the wire-slice geometry. Same inline math (nvfp4.h).
#include <string.h>

#include "common/check.h"
#include "common/dtype.h"
#include "kernels/api.h"
#include "kernels/codecs/mxfp8.h"
#include "kernels/codecs/nvfp4.h"
#include "kernels/codecs/nvfp4_api.h"
#include "kernels/cpu_twin.h"

namespace nv = rx::nv;

namespace rx::nv {

namespace {

uint32_t load_amax(const rx_box& b) {
  uint32_t a;
  memcpy(&a, reinterpret_cast<const void*>(box_amax(b)), sizeof(a));
  return a;
}

// One innermost row of an NVFP4 box into dst (contiguous for data; the box's stride for
// scales): `n` packed bytes (data, n a multiple of 8) or scale bytes.
void row(const rx_box& box, const char* src, char* dst, int64_t dst_stride, int64_t n) {
  const TensorScale t = tensor_scale(load_amax(box));
  uint32_t w[kBlockWords];
  if (!box_is_data(box)) {
    const int64_t ss = box.src_stride[box.ndim - 1] * 4;
    for (int64_t j = 0; j < n; ++j) {
      memcpy(w, src + j * ss, sizeof(w));
      dst[j * dst_stride] = static_cast<char>(quantize_block(w, t, nullptr));
    }
    return;
  }
  uint32_t packed[2];
  for (int64_t g = 0; g < n / kBlockWords; ++g) {
    memcpy(w, src + g * kBlockWords * 4, sizeof(w));
    quantize_block(w, t, packed);
    memcpy(dst + g * kBlockWords, packed, sizeof(packed));
  }
}

}  // namespace

uint64_t cpu_row(const rx_box& box, int32_t pass, const char* src, char* dst, int64_t first, uint64_t k0, int64_t n) {
  (void)first;  // no placed side bytes
  const int64_t stride = box.dst_stride[box.ndim - 1];
  if (pass == RX_PASS_NONE) {
    row(box, src, dst, stride, n);
    return 0;
  }
  alignas(16) char tmp[cpu::kChunk];
  const char* at = dst;
  int64_t at_stride = stride;
  if (pass == RX_PASS_COPY) {
    row(box, src, dst, stride, n);
  } else if (pass == RX_PASS_SRC) {  // what the box would write, into a temporary row
    row(box, src, tmp, 1, n);
    at = tmp;
    at_stride = 1;
  }
  return cpu::hash_elems(at, at_stride, box.dst_dtype, box.digest, k0, n);
}

bool box_valid(const rx_box& b) {
  if (b.codec == RX_CODEC_NONE) return false;  // no receiver digest
  if (RX_CODEC_FLAGS(b.codec) != 0 || RX_DIGEST_KIND(b.digest) != RX_DIGEST_AS_WRITTEN) return false;
  if (b.param[0] == 0 || b.param[1] < 0 || b.param[2] != 0) return false;
  if (b.src_dtype != RX_I32) return false;
  const int inner = b.ndim - 1;
  if (RX_CODEC_ID(b.codec) == RX_CODEC_NVFP4_SCALES) return b.dst_dtype == RX_U8 || b.dst_dtype == RX_F8E4M3;
  return RX_CODEC_ID(b.codec) == RX_CODEC_NVFP4 && b.dst_dtype == RX_U8 && b.src_stride[inner] == 1 &&
         b.dst_stride[inner] == 1 && b.shape[inner] % kBlockWords == 0;
}

// A data box's item is one block (8 words in, 8 bytes out, never split); a scales box's,
// one scale byte, which reads a block. The planner cuts a data tensor's packed last dim
// on whole blocks; a scale tensor's elements are whole blocks already (grain 1).
const codecs::Traits kDataTraits{RX_CODEC_NVFP4, "nvfp4", kBlockWords, kBlockWords, kBlock * 2, box_valid, cpu_row,
                                 nullptr};
const codecs::Traits kScalesTraits{RX_CODEC_NVFP4_SCALES, "nvfp4_scales", 1, 1, kBlock * 2, box_valid, cpu_row,
                                   nullptr};

std::string coarse_runs(const Runs& runs, int64_t extent, int64_t per, Runs* out) {
  out->clear();
  if (extent % kBlock != 0)
    return detail::format("its last dim has ", extent, " elements, not a multiple of the ", kBlock,
                          "-element block (torchao's NVFP4 requires that too)");
  for (const Run& r : runs) {
    if (r.len == 0) continue;
    RX_HOST_ASSERT(r.start >= 0 && r.start + r.len <= extent, "run outside the dim");
    if (r.start % kBlock != 0 || r.len % kBlock != 0)
      return detail::format("the piece covers elements [", r.start, ", ", r.start + r.len,
                            ") of the last dim, which is not made of whole ", kBlock, "-element blocks");
    append_run(*out, Run{r.start / per, r.len / per});
  }
  return "";
}

}  // namespace rx::nv

namespace {

bool shape_ok(int64_t rows, int64_t cols, int64_t row_stride) {
  return rows >= 0 && cols >= 0 && cols % nv::kBlock == 0 && (rows <= 1 || row_stride >= cols);
}

}  // namespace

extern "C" int32_t rx_nvfp4_quantize_cpu(const uint16_t* bf16, int64_t rows, int64_t cols, int64_t row_stride,
                                         const uint32_t* amax, uint8_t* data, uint8_t* scale, int32_t scale_layout,
                                         float* tensor_scale) {
  if (!shape_ok(rows, cols, row_stride)) return -1;
  if (scale_layout != RX_NV_SCALE_2D && scale_layout != RX_NV_SCALE_SWIZZLED) return -1;
  const nv::TensorScale t = nv::tensor_scale(*amax);
  if (tensor_scale) memcpy(tensor_scale, &t.pts, sizeof(float));
  const int64_t scols = cols / nv::kBlock;
  const bool swz = scale_layout == RX_NV_SCALE_SWIZZLED;
  if (swz) memset(scale, 0, static_cast<size_t>(rx::mx::swizzled_size(rows, scols)));  // padding is 0
  uint32_t w[nv::kBlockWords], packed[2];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < scols; ++b) {
      memcpy(w, bf16 + r * row_stride + b * nv::kBlock, sizeof(w));
      const uint8_t s = nv::quantize_block(w, t, packed);
      memcpy(data + r * (cols / 2) + b * nv::kBlockWords, packed, sizeof(packed));
      scale[swz ? rx::mx::swizzled_offset(r, b, scols) : r * scols + b] = s;
    }
  return 0;
}

extern "C" int32_t rx_nvfp4_tensor_scale_cpu(const uint32_t* amax, float* tensor_scale) {
  const uint32_t pts = nv::tensor_scale_bits(*amax);
  memcpy(tensor_scale, &pts, sizeof(float));
  return 0;
}
