// Which memory a strided view touches, and whether two views may share some of it.
// The answers are conservative: "may overlap" can be a false alarm for exotic views
// (then the caller refuses them), "disjoint" is always true.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace rx {

// A strided view: element `i` (a multi-index) is at base + sum(i[d] * stride[d]) * elem.
struct View {
  uint64_t base = 0;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // elements, >= 0 (torch makes no negative strides)
  int64_t elem = 1;              // bytes per element

  bool empty() const;
  // [lo(), hi()): every byte the view touches lies inside (base is the lowest one).
  uint64_t lo() const { return base; }
  uint64_t hi() const;
};

// True when two elements of the view may be the same memory (a stride-0 dim, or dims
// whose strides interleave): checked by sorting its dims by stride, each stride must
// step past everything the smaller dims reach.
bool self_overlaps(const View& v);

// True when the two views may share a byte. Disjoint spans never do; nor do views that
// repeat with a common period (an outer stride both have, their other dims fitting in
// one period) at offsets that do not meet modulo that period: interleaved views such as
// Megatron's per-group q/k/v heads or column blocks of one row-major matrix.
bool may_overlap(const View& a, const View& b);

// Pairs (i, j), i < j, of `views` that may overlap (empty views never do), found by a
// sweep over their spans: O(n log n) plus the pairs whose spans meet.
std::vector<std::pair<size_t, size_t>> overlapping_pairs(const std::vector<const View*>& views);

}  // namespace rx
