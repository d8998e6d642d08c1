// What the CPU twin of the box copy (copy_boxes_cpu.cc) shares with the codecs' CPU twins.
#pragma once

#include <stdint.h>

namespace rx::cpu {

// Elements a verify pass handles per step: a chunk just written is hashed while it is
// still in cache. A multiple of every codec's block.
constexpr int64_t kChunk = 2048;

// The digest terms (kernels/digest.h) of `n` elements of `dtype` at p (stride in
// elements) at ordinals k0.., as a box with digest spec `digest` (core/box.h) has the
// receiver hold them.
uint64_t hash_elems(const char* p, int64_t stride, int32_t dtype, int32_t digest, uint64_t k0, int64_t n);

}  // namespace rx::cpu
