// Layout: how one logical tensor is spread over the ranks of a process group
// (DESIGN section 1). Rank-independent: every rank builds the same object.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/dtype.h"
#include "core/runs.h"

namespace rx {

// An N-d array of group ranks, stored row-major.
class Mesh {
 public:
  Mesh(std::vector<int64_t> shape, std::vector<int32_t> ranks);

  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<int32_t>& ranks() const { return ranks_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t size() const { return static_cast<int64_t>(ranks_.size()); }
  // Linear position of `rank` in the mesh, or -1.
  int64_t position(int32_t rank) const;
  bool same_as(const Mesh& o) const { return shape_ == o.shape_ && ranks_ == o.ranks_; }
  // Empty when well formed.
  const std::string& error() const { return error_; }
  std::string describe() const;

 private:
  std::vector<int64_t> shape_;
  std::vector<int32_t> ranks_;
  std::unordered_map<int32_t, int64_t> position_;
  std::string error_;
};

// One entry per mesh dim. shard_dim == kReplicate: Replicate; any other value is a Shard,
// valid when 0 <= shard_dim < ndim (negative dims are normalised by the Python layer, so
// an invalid one stays visible in the layout's error rather than reading as Replicate).
constexpr int32_t kReplicate = INT32_MIN;
struct Placement {
  int32_t shard_dim = kReplicate;
  int64_t stride = 1;
  std::vector<int64_t> blocks;  // packed blocks of the dim as it stands before this split
  // Uneven contiguous split: coordinate c holds sizes[c] elements after those of 0..c-1
  // (an engine's padded vocabulary: full chunks, a short one, empty ones).
  std::vector<int64_t> sizes;
  bool is_shard() const { return shard_dim != kReplicate; }
  bool operator==(const Placement& o) const {
    return shard_dim == o.shard_dim && stride == o.stride && blocks == o.blocks && sizes == o.sizes;
  }
};

using Piece = std::vector<Runs>;

// The local ranges (local_start, len) a mesh coordinate `c` of `parts` takes from a
// dim piece of length `len`. Throws ReshardError when the split is impossible.
std::vector<std::pair<int64_t, int64_t>> shard_ranges(int64_t len, int64_t parts, int64_t c,
                                                      const Placement& p);

class Layout {
 public:
  Layout(std::vector<int64_t> shape, int32_t dtype, std::shared_ptr<const Mesh> mesh,
         std::vector<Placement> placements);

  const std::vector<int64_t>& shape() const { return shape_; }
  int32_t dtype() const { return dtype_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  const Mesh& mesh() const { return *mesh_; }
  const std::shared_ptr<const Mesh>& mesh_ptr() const { return mesh_; }
  const std::vector<Placement>& placements() const { return placements_; }
  int64_t numel() const { return numel_; }
  // Empty when the layout is valid; checked once at construction.
  const std::string& error() const { return error_; }
  bool same_as(const Layout& o) const;
  std::string describe() const;

  // Shard classes: the distinct pieces. Ranks that differ only along Replicate mesh
  // dims hold the same piece; a class is a coordinate over the Shard mesh dims.
  int64_t num_classes() const { return num_classes_; }
  int64_t class_of_position(int64_t mesh_pos) const;
  // Which of its class's replicas the rank at `mesh_pos` is (the j of class_replica).
  int64_t replica_of_position(int64_t mesh_pos) const;
  Piece class_piece(int64_t cls) const;
  // The j-th rank (in mesh order) holding class `cls`, 0 <= j < replicas_per_class().
  int32_t class_replica(int64_t cls, int64_t j) const;
  int64_t replicas_per_class() const { return mesh_->size() / num_classes_; }
  // Bit i set: mesh dim i shards the tensor. With the mesh, it fixes which ranks share
  // a class, whatever the tensor's shape.
  uint32_t shard_mask() const { return shard_mask_; }

  // The piece of `rank`, or false when the rank is not in the mesh.
  bool piece_of(int32_t rank, Piece* out) const;
  std::vector<int64_t> local_shape(const Piece& piece) const;

 private:
  void validate();

  std::vector<int64_t> shape_;
  int32_t dtype_;
  std::shared_ptr<const Mesh> mesh_;
  std::vector<Placement> placements_;
  std::vector<int> shard_mesh_dims_;  // mesh dims with a Shard placement, in order
  std::vector<int> repl_mesh_dims_;
  std::vector<int> all_mesh_dims_;
  int64_t num_classes_ = 1;
  int64_t numel_ = 1;
  uint32_t shard_mask_ = 0;
  std::string error_;
};

}  // namespace rx
