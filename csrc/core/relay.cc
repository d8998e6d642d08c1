#include "core/relay.h"

#include "common/dtype.h"

namespace rx {

namespace {

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
  struct Class {
    Piece piece;
    int64_t holders = 0, local = 0;  // h and j of the model above
  };
  std::vector<Class> classes;  // the non-empty dst classes
  for (int64_t c = 0; c < dst.num_classes(); ++c) {
    Class cl{dst.class_piece(c)};
    if (volume(cl.piece) == 0) continue;
    const int64_t want = volume(cl.piece);
    for (int64_t s = 0; s < src.num_classes(); ++s) {
      int64_t common = 1;  // elements of the class piece that src class s holds
      for (size_t d = 0; d < held[s].size() && common > 0; ++d) {
        int64_t len = 0;
        for (const Segment& g : intersect(held[s][d], cl.piece[d])) len += g.len;
        common *= len;
      }
      if (common == 0) continue;
      cl.holders += src.replicas_per_class();
      if (cl.holders >= k) return out;  // as many holders as receivers: nothing to gain
      for (int64_t r = 0; common == want && r < src.replicas_per_class(); ++r) {
        const int64_t pos = dst.mesh().position(src.class_replica(s, r));
        cl.local += pos >= 0 && dst.class_of_position(pos) == c;
      }
    }
    classes.push_back(std::move(cl));
  }
  if (classes.empty()) return out;

  // The split dim and its largest share (share / n: the worst over the classes).
  int32_t dim = -1, best = -1;
  int64_t share = 0, n = 1, best_share = 0, best_n = 1;
  for (int32_t d = 0; d < dst.ndim(); ++d) {
    bool near_even = true;
    int64_t ws = 0, wn = 1;
    for (const Class& cl : classes) {
      const int64_t len = total_len(cl.piece[d]);
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
  const int64_t dsz = dtype_size(dst.dtype());
  const int64_t wsz = dtype_size(wire_dtype_for(src.dtype(), dst.dtype()));
  // Relay when sum_c (k - j_c) / (k h_c) > C s rho (relay.h), in integers: each term
  // scaled by k * kScale (rounded down: a deterministic, rank-independent comparison).
  constexpr int64_t kScale = int64_t{1} << 20;
  __int128 gain = 0;
  for (const Class& cl : classes) gain += (k - cl.local) * kScale / cl.holders;
  const __int128 cost = static_cast<__int128>(classes.size()) * k * kScale * share * dsz;
  if (!(gain * n * wsz > cost)) return out;
  out.dim = dim;
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
