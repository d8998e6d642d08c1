// Relay fan-out (DESIGN section 4, step 3). Where a dst tensor's class (a distinct
// piece) has more replicas than there are src ranks holding its data, the refit runs in
// two ordinary plans: a scatter, in which each of the class's k replicas receives 1/k
// of the class piece from the sources, then an all-gather among the replicas. A source
// then sends each byte about once whatever the number of replicas.
//
// The scatter's dst layout is the dst layout with its mesh transposed (Shard mesh dims
// first, Replicate dims flattened last, in replica order) and the Replicate placements
// replaced by one Shard(dim) over the k replicas: it subdivides each class piece along
// `dim` in local order, so a replica's share is one contiguous range of its dst tensor
// along that dim (a view, which the all-gather then reads as its source).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/layout.h"
#include "core/planner.h"

namespace rx {

struct RelaySplit {
  int32_t dim = -1;      // the tensor dim the replicas split their class piece along; -1: no relay
  int64_t replicas = 1;  // k: dst replicas per class
};

// Whether relaying helps, from the layouts alone. Model (time in units of one class piece
// on one link): h_c src ranks hold data of dst class c, and j_c of its k replicas hold
// all of it themselves (a local copy). Direct, the holders send k - j_c copies:
// (k - j_c) / h_c. Relayed: the scatter takes (1 - j_c / k) / h_c, the all-gather
// (k - 1) s rho, where s is the largest share of a class piece and rho the dst element
// size over the wire's (the all-gather moves dst elements: a bf16 -> f32 refit doubles
// its bytes). The gain, summed over the C classes (holders often serve several), is
// (k - 1) (sum_c (k - j_c) / (k h_c) - C s rho): relay when it is positive.
// The split dim: the outermost whose shares are within 1/8 of even in every class (whole
// rows keep views contiguous), else the one with the smallest largest share.
RelaySplit relay_split(const Layout& src, const Layout& dst);

// (dst table index, split dim) of every dst tensor that relays, in table order.
std::vector<std::pair<int32_t, int32_t>> relay_splits(const LayoutTable& src, const LayoutTable& dst);

}  // namespace rx
