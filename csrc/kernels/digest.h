// Verify digests (rx.execute(verify=True), rx.verify), shared by the CUDA kernel and the
// CPU twin so both produce the same 64-bit values.
//
// A box's digest is the sum, over the elements the receiver ends up holding from it, of
// element(ordinal, bits); a digest is two independent 32-bit sums (its low and high
// word, added lane by lane: add()), so every operation has 32-bit lanes (CPU vectors,
// GPU integer units) and the sum needs no carries between partial sums.
//   ordinal: the element's place in the row-major order of the box's logical extents.
//     make_box only drops size-1 dims and merges neighbours, never reorders, so the
//     sender's pack box and the receiver's unpack box of one op enumerate the same
//     elements in the same order however differently they fold.
//   bits: the element as the receiver holds it (after casts and codecs), zero-extended.
// A sum of per-element terms lets any split of a box (tiles, warps, chunks) add up in
// any order. A term is the exact 64-bit square of the element's 32-bit word xor its
// ordinal's key: one widening multiply per element (vpmuludq on CPUs, IMAD.WIDE on GPUs).
// Squaring is injective on 32-bit words, so one changed element (a NaN payload, -0.0 for
// +0.0) always changes at least one lane of the sum; the key makes it nonlinear in the
// ordinal, so moved elements (swapped rows, shifted boxes) change it too, short of a
// coincidence: ~2^-64, or ~2^-32 for changes confined to the words' top bits (a square's
// low word ignores them). A checksum against corruption, not a MAC.
#pragma once

#include <stdint.h>

#include "kernels/cast.h"

namespace rx::digest {

constexpr uint32_t kKeyLo = 0x9E3779B9u;  // ordinal -> 32-bit key
constexpr uint32_t kKeyHi = 0x7FEB352Du;
// Added to an element's key for the high word of an 8-byte element, and to a block's key
// for its scale byte, so that those words do not share keys with the low words.
constexpr uint32_t kHiSalt = 0x6A09E667u;
constexpr uint32_t kScaleSalt = 0xBB67AE85u;

RX_HD uint32_t key(uint64_t k) { return (uint32_t)k * kKeyLo + (uint32_t)(k >> 32) * kKeyHi; }

// Digests add word by word: (low + low) mod 2^32, (high + high) mod 2^32.
RX_HD uint64_t add(uint64_t a, uint64_t b) {
  return (uint64_t)((uint32_t)a + (uint32_t)b) | (uint64_t)((uint32_t)(a >> 32) + (uint32_t)(b >> 32)) << 32;
}

// The term of a keyed 32-bit word: its exact square (low and high word).
RX_HD uint64_t sq(uint32_t x) { return (uint64_t)x * x; }

// The term of one element of `size` bytes with (zero-extended) `bits` under key kk.
// key(k + j) = key(k) + j * kKeyLo while the low word of k + j does not wrap, so a run of
// elements needs one key() and then one add per element.
RX_HD uint64_t keyed(uint32_t kk, uint64_t bits, int size) {
  const uint64_t h = sq((uint32_t)bits ^ kk);
  return size == 8 ? add(h, sq((uint32_t)(bits >> 32) ^ (kk + kHiSalt))) : h;
}

// The term of one element of `size` bytes with (zero-extended) `bits` at ordinal k.
RX_HD uint64_t element(uint64_t k, uint64_t bits, int size) { return keyed(key(k), bits, size); }

// Four bytes packed little-endian (E4M3 data) at ordinals k..k+3.
RX_HD uint64_t bytes4(uint64_t k, uint32_t q) {
  uint64_t h = 0;
  for (int j = 0; j < 4; ++j) h = add(h, element(k + j, (q >> (8 * j)) & 0xffu, 1));
  return h;
}

// The scale byte of the block with ordinal `block` of a block-scaled codec (MXFP8: its
// first element's ordinal / 32).
RX_HD uint64_t scale(uint64_t block, uint8_t e) { return sq(e ^ (key(block) + kScaleSalt)); }

}  // namespace rx::digest
