#include "core/overlap.h"

#include <algorithm>
#include <utility>

namespace rx {

namespace {

// Bytes from the view's first byte past its last one, leaving out dim `skip` (-1: none).
// Views come from tensors whose byte extents fit 64 bits, so this does too.
uint64_t extent_without(const View& v, int skip) {
  uint64_t n = 0;
  for (size_t d = 0; d < v.shape.size(); ++d)
    if (static_cast<int>(d) != skip) n += static_cast<uint64_t>(v.shape[d] - 1) * static_cast<uint64_t>(v.strides[d]);
  return (n + 1) * static_cast<uint64_t>(v.elem);
}

// Circular intervals [a, a + la) and [b, b + lb) modulo p (la, lb <= p) meet.
bool meet_modulo(uint64_t a, uint64_t la, uint64_t b, uint64_t lb, uint64_t p) {
  a %= p;
  b %= p;
  const uint64_t d = b >= a ? b - a : b + p - a;  // b's offset from a, in [0, p)
  return d < la || p - d < lb;
}

}  // namespace

bool View::empty() const {
  for (int64_t n : shape)
    if (n == 0) return true;
  return false;
}

uint64_t View::hi() const { return base + extent_without(*this, -1); }

bool self_overlaps(const View& v) {
  if (v.empty()) return false;
  std::vector<size_t> dims;
  for (size_t d = 0; d < v.shape.size(); ++d)
    if (v.shape[d] > 1) dims.push_back(d);
  std::sort(dims.begin(), dims.end(), [&](size_t a, size_t b) { return v.strides[a] < v.strides[b]; });
  uint64_t reach = 1;  // elements the smaller dims span
  for (size_t d : dims) {
    const uint64_t s = static_cast<uint64_t>(v.strides[d]);
    if (s < reach) return true;
    reach += s * static_cast<uint64_t>(v.shape[d] - 1);
  }
  return false;
}

bool may_overlap(const View& a, const View& b) {
  if (a.empty() || b.empty() || a.hi() <= b.lo() || b.hi() <= a.lo()) return false;
  for (size_t i = 0; i < a.shape.size(); ++i) {
    if (a.shape[i] <= 1) continue;
    const uint64_t period = static_cast<uint64_t>(a.strides[i]) * static_cast<uint64_t>(a.elem);
    const uint64_t ra = extent_without(a, static_cast<int>(i));
    if (period == 0 || ra > period) continue;
    for (size_t j = 0; j < b.shape.size(); ++j) {
      if (b.shape[j] <= 1 || static_cast<uint64_t>(b.strides[j]) * static_cast<uint64_t>(b.elem) != period) continue;
      const uint64_t rb = extent_without(b, static_cast<int>(j));
      if (rb <= period && !meet_modulo(a.base, ra, b.base, rb, period)) return false;
    }
  }
  return true;
}

std::vector<std::pair<size_t, size_t>> overlapping_pairs(const std::vector<const View*>& views) {
  std::vector<size_t> order;
  for (size_t i = 0; i < views.size(); ++i)
    if (!views[i]->empty()) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return views[x]->lo() < views[y]->lo(); });
  std::vector<std::pair<size_t, size_t>> out;
  std::vector<size_t> active;  // views whose span may still reach the next one's start
  for (size_t i : order) {
    const uint64_t lo = views[i]->lo();
    active.erase(std::remove_if(active.begin(), active.end(), [&](size_t k) { return views[k]->hi() <= lo; }),
                 active.end());
    for (size_t k : active)
      if (may_overlap(*views[k], *views[i])) out.emplace_back(std::min(k, i), std::max(k, i));
    active.push_back(i);
  }
  return out;
}

}  // namespace rx
