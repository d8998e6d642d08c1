#include "core/relay.h"

#include <algorithm>

#include "kernels/api.h"

namespace rx {

namespace {

bool overlaps(const Piece& a, const Piece& b) {
  for (size_t d = 0; d < a.size(); ++d)
    if (intersect(a[d], b[d]).empty()) return false;
  return true;
}

int64_t volume(const Piece& p) {
  int64_t n = 1;
  for (const Runs& r : p) n *= total_len(r);
  return n;
}

}  // namespace

RelaySplit relay_split(const Layout& src, const Layout& dst) {
  RelaySplit out;
  if (!src.error().empty() || !dst.error().empty() || src.shape() != dst.shape() || dst.numel() == 0) return out;
  const int64_t k = dst.replicas_per_class();
  out.replicas = k;
  if (k <= 1 || src.replicas_per_class() >= k || dst.ndim() == 0) return out;

  std::vector<Piece> held(src.num_classes());
  for (int64_t s = 0; s < src.num_classes(); ++s) held[s] = src.class_piece(s);
  std::vector<Piece> classes;  // the non-empty dst class pieces
  int64_t h = 0;
  for (int64_t c = 0; c < dst.num_classes(); ++c) {
    Piece p = dst.class_piece(c);
    if (volume(p) == 0) continue;
    int64_t m = 0;
    for (const Piece& q : held) {
      if (!overlaps(p, q)) continue;
      m += src.replicas_per_class();
      if (m >= k) return out;  // as many holders as receivers: nothing to gain
    }
    h = std::max(h, m);
    classes.push_back(std::move(p));
  }
  if (h == 0) return out;

  // The split dim and its largest share (share / n: the worst over the classes).
  int32_t dim = -1, best = -1;
  int64_t share = 0, n = 1, best_share = 0, best_n = 1;
  for (int32_t d = 0; d < dst.ndim(); ++d) {
    bool near_even = true;
    int64_t ws = 0, wn = 1;
    for (const Piece& p : classes) {
      const int64_t len = total_len(p[d]);
      const int64_t sh = (len + k - 1) / k;  // torch.chunk, as a Shard splits
      near_even = near_even && 8 * sh * k <= 9 * len;
      if (sh * wn > ws * len) ws = sh, wn = len;
    }
    if (near_even) {
      dim = d, share = ws, n = wn;
      break;
    }
    if (best < 0 || ws * best_n < best_share * wn) best = d, best_share = ws, best_n = wn;
  }
  if (dim < 0) dim = best, share = best_share, n = best_n;
  const int64_t dsz = rx_dtype_size(dst.dtype());
  const int64_t wsz = rx_dtype_size(wire_dtype_for(src.dtype(), dst.dtype()));
  // 1/h + (k-1) * (share/n) * (dsz/wsz) < k/h, times h * n * wsz
  if (n * wsz + (k - 1) * share * dsz * h < k * n * wsz) out.dim = dim;
  out.holders = h;
  return out;
}

std::vector<std::pair<int32_t, int32_t>> relay_splits(const LayoutTable& src, const LayoutTable& dst) {
  std::vector<std::pair<int32_t, int32_t>> out;
  for (int32_t i = 0; i < dst.size(); ++i) {
    const int32_t j = src.find(dst.name(i));
    if (j < 0) continue;
    const RelaySplit r = relay_split(src.layout(j), dst.layout(i));
    if (r.dim >= 0) out.emplace_back(i, r.dim);
  }
  return out;
}

}  // namespace rx
