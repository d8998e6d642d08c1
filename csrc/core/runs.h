// Runs: how one tensor dim of a rank's piece maps to the global dim.
// A piece along a dim is a list of runs (global_start, length) in local order; the
// local index of a run's first element is the sum of the lengths before it.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace rx {

struct Run {
  int64_t start;  // global index of the first element
  int64_t len;
  bool operator==(const Run& o) const { return start == o.start && len == o.len; }
};
using Runs = std::vector<Run>;

int64_t total_len(const Runs& runs);

// Appends a run, merging it into the last one when they are globally contiguous.
void append_run(Runs& runs, Run r);

// Selects local ranges (local_start, len), in the order given, from `runs`.
Runs select_local(const Runs& runs, const std::vector<std::pair<int64_t, int64_t>>& ranges);

// Where two pieces overlap along one dim: a global range and its local offset in each.
struct Segment {
  int64_t global;
  int64_t len;
  int64_t a_local;
  int64_t b_local;
};

// The overlap of two run lists, sorted by global start, with segments merged where
// they are contiguous globally and in both local orders.
std::vector<Segment> intersect(const Runs& a, const Runs& b);

}  // namespace rx
