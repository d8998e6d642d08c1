#include "core/runs.h"

#include <algorithm>

#include "common/check.h"
#include "core/checked.h"

namespace rx {

int64_t total_len(const Runs& runs) {
  int64_t n = 0;
  for (const Run& r : runs) n = checked_add(n, r.len, "length of a piece");
  return n;
}

void append_run(Runs& runs, Run r) {
  if (r.len <= 0) return;
  if (!runs.empty() && runs.back().start + runs.back().len == r.start) {
    runs.back().len += r.len;
  } else {
    runs.push_back(r);
  }
}

Runs select_local(const Runs& runs, const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  Runs out;
  if (runs.size() == 1) {  // the common case: one contiguous run
    for (const auto& [lo, len] : ranges) {
      RX_HOST_ASSERT(lo >= 0 && lo + len <= runs[0].len, "range outside the piece");
      append_run(out, {runs[0].start + lo, len});
    }
    return out;
  }
  std::vector<int64_t> offs(runs.size() + 1, 0);
  for (size_t i = 0; i < runs.size(); ++i) offs[i + 1] = offs[i] + runs[i].len;
  for (const auto& [lo, len] : ranges) {
    RX_HOST_ASSERT(lo >= 0 && lo + len <= offs.back(), "range outside the piece");
    if (len <= 0) continue;
    size_t i = std::upper_bound(offs.begin(), offs.end(), lo) - offs.begin() - 1;
    int64_t pos = lo, end = lo + len;
    while (pos < end) {
      int64_t in_run = pos - offs[i];
      int64_t take = std::min(end - pos, runs[i].len - in_run);
      append_run(out, {runs[i].start + in_run, take});
      pos += take;
      ++i;
    }
  }
  return out;
}

std::vector<Segment> intersect(const Runs& a, const Runs& b) {
  if (a.size() == 1 && b.size() == 1) {  // the common case: one run each
    const int64_t lo = std::max(a[0].start, b[0].start);
    const int64_t hi = std::min(a[0].start + a[0].len, b[0].start + b[0].len);
    if (lo >= hi) return {};
    return {Segment{lo, hi - lo, lo - a[0].start, lo - b[0].start}};
  }
  // (global start, len, local start) sorted by global start.
  struct Item { int64_t g, len, local; };
  auto sorted = [](const Runs& runs) {
    std::vector<Item> v;
    v.reserve(runs.size());
    int64_t local = 0;
    for (const Run& r : runs) {
      if (r.len > 0) v.push_back({r.start, r.len, local});
      local += r.len;
    }
    std::sort(v.begin(), v.end(), [](const Item& x, const Item& y) { return x.g < y.g; });
    return v;
  };
  std::vector<Item> va = sorted(a), vb = sorted(b);
  std::vector<Segment> out;
  size_t i = 0, j = 0;
  while (i < va.size() && j < vb.size()) {
    int64_t lo = std::max(va[i].g, vb[j].g);
    int64_t hi = std::min(va[i].g + va[i].len, vb[j].g + vb[j].len);
    if (lo < hi) {
      Segment s{lo, hi - lo, va[i].local + (lo - va[i].g), vb[j].local + (lo - vb[j].g)};
      if (!out.empty()) {
        Segment& p = out.back();
        if (p.global + p.len == s.global && p.a_local + p.len == s.a_local && p.b_local + p.len == s.b_local) {
          p.len += s.len;
          s.len = 0;
        }
      }
      if (s.len > 0) out.push_back(s);
    }
    if (va[i].g + va[i].len < vb[j].g + vb[j].len) ++i; else ++j;
  }
  return out;
}

}  // namespace rx
