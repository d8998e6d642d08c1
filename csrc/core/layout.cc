#include "core/layout.h"

#include "common/check.h"
#include "common/dtype.h"
#include "core/checked.h"

namespace rx {

Mesh::Mesh(std::vector<int64_t> shape, std::vector<int32_t> ranks)
    : shape_(std::move(shape)), ranks_(std::move(ranks)) {
  if (shape_.size() > 16) error_ = "meshes have at most 16 dims";
  int64_t n = 1;
  for (int64_t s : shape_) {
    if (s <= 0) error_ = "mesh dims must be positive";
    if (__builtin_mul_overflow(n, s, &n)) error_ = "mesh shape overflows a 64-bit integer";
  }
  if (error_.empty() && n != static_cast<int64_t>(ranks_.size()))
    error_ = detail::format("mesh shape holds ", n, " ranks but ", ranks_.size(), " were given");
  position_.reserve(ranks_.size());
  for (size_t i = 0; i < ranks_.size(); ++i) {
    if (ranks_[i] < 0 && error_.empty()) error_ = detail::format("negative rank ", ranks_[i], " in mesh");
    if (!position_.emplace(ranks_[i], static_cast<int64_t>(i)).second && error_.empty())
      error_ = detail::format("rank ", ranks_[i], " appears twice in the mesh");
  }
}

int64_t Mesh::position(int32_t rank) const {
  auto it = position_.find(rank);
  return it == position_.end() ? -1 : it->second;
}

namespace {
// Python's tuple repr: "(2,)", "(4, 8)", "()".
std::string py_tuple(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += detail::format(i ? ", " : "", v[i]);
  return s + (v.size() == 1 ? ",)" : ")");
}
}  // namespace

// The same text as reshard_ext.Mesh's repr (Python uses this one).
std::string Mesh::describe() const {
  std::string s = "Mesh(shape=" + py_tuple(shape_) + ", ranks=[";
  for (size_t i = 0; i < ranks_.size(); ++i) s += detail::format(i ? ", " : "", ranks_[i]);
  return s + "])";
}

std::vector<std::pair<int64_t, int64_t>> shard_ranges(int64_t len, int64_t parts, int64_t c,
                                                      const Placement& p) {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (!p.sizes.empty()) {
    RX_USER_CHECK(p.stride == 1 && p.blocks.empty(), "Shard(", p.shard_dim,
                  ", sizes=...) cannot be combined with stride or blocks");
    RX_USER_CHECK(static_cast<int64_t>(p.sizes.size()) == parts, "Shard(", p.shard_dim, ", sizes=...) gives ",
                  p.sizes.size(), " sizes for a mesh dim of ", parts);
    int64_t start = 0, sum = 0;
    for (size_t i = 0; i < p.sizes.size(); ++i) {
      RX_USER_CHECK(p.sizes[i] >= 0, "negative shard size ", p.sizes[i]);
      if (static_cast<int64_t>(i) < c) start = checked_add(start, p.sizes[i], "shard offset");
      sum = checked_add(sum, p.sizes[i], "sum of shard sizes");
    }
    RX_USER_CHECK(sum == len, "shard sizes sum to ", sum, " but dim ", p.shard_dim, " has length ", len,
                  " where this mesh dim splits it");
    if (p.sizes[c] > 0) out.emplace_back(start, p.sizes[c]);
    return out;
  }
  std::vector<int64_t> blocks = p.blocks;
  if (blocks.empty()) {
    blocks.push_back(len);
  } else {
    int64_t sum = 0;
    for (int64_t b : blocks) {
      RX_USER_CHECK(b >= 0, "negative block size ", b);
      sum = checked_add(sum, b, "sum of packed blocks");
    }
    RX_USER_CHECK(sum == len, "packed blocks sum to ", sum, " but dim ", p.shard_dim,
                  " has length ", len, " where this mesh dim splits it");
  }
  RX_USER_CHECK(p.stride >= 1, "Shard stride must be >= 1, got ", p.stride);
  int64_t offset = 0;
  for (int64_t b : blocks) {
    if (p.stride == 1) {
      const int64_t chunk = b / parts + (b % parts != 0);  // torch.chunk semantics
      const int64_t lo = std::min(checked_mul(c, chunk, "shard offset"), b), hi = lo + std::min(chunk, b - lo);
      if (hi > lo) out.emplace_back(offset + lo, hi - lo);
    } else {
      const int64_t period = checked_mul(parts, p.stride, "Shard stride times mesh size");
      RX_USER_CHECK(b % period == 0, "strided shard of dim ", p.shard_dim, ": length ", b,
                    " is not divisible by parts*stride = ", parts, "*", p.stride);
      const int64_t chunk = b / period;
      for (int64_t j = 0; j < p.stride; ++j)
        if (chunk > 0) out.emplace_back(offset + (c + j * parts) * chunk, chunk);
    }
    offset += b;
  }
  return out;
}

Layout::Layout(std::vector<int64_t> shape, int32_t dtype, std::shared_ptr<const Mesh> mesh,
               std::vector<Placement> placements)
    : shape_(std::move(shape)), dtype_(dtype), mesh_(std::move(mesh)), placements_(std::move(placements)) {
  for (int64_t s : shape_) {
    if (__builtin_mul_overflow(numel_, s, &numel_)) {
      error_ = detail::format("number of elements of the shape overflows a 64-bit integer");
      return;  // reported by rx.plan on every rank, like any invalid layout
    }
  }
  validate();
}

void Layout::validate() {
  if (!mesh_) { error_ = "layout has no mesh"; return; }
  if (!mesh_->error().empty()) { error_ = mesh_->error(); return; }
  if (dtype_size(dtype_) == 0) { error_ = detail::format("unsupported dtype code ", dtype_); return; }
  for (int64_t s : shape_)
    if (s < 0) { error_ = "negative dim in shape"; return; }
  if (static_cast<int>(placements_.size()) != mesh_->ndim()) {
    error_ = detail::format(placements_.size(), " placements for a ", mesh_->ndim(), "-d mesh");
    return;
  }
  for (int i = 0; i < mesh_->ndim(); ++i) {
    all_mesh_dims_.push_back(i);
    const Placement& p = placements_[i];
    if (p.is_shard()) {
      if (p.shard_dim < 0 || p.shard_dim >= ndim()) {
        error_ = detail::format("Shard(", p.shard_dim, ") of a ", ndim(), "-d tensor (dims are -", ndim(), " to ",
                                ndim() - 1, ")");
        return;
      }
      shard_mesh_dims_.push_back(i);
      shard_mask_ |= 1u << i;
      num_classes_ *= mesh_->shape()[i];
    } else {
      repl_mesh_dims_.push_back(i);
    }
  }
  // Every class piece must be computable, and together they must tile the tensor
  // exactly once (this catches blocks/strides that disagree with the shape).
  try {
    // Every byte of the tensor must be addressable: offsets and sizes of its boxes
    // are then 64-bit safe everywhere downstream.
    checked_mul(numel(), dtype_size(dtype_), "bytes of the tensor");
    int64_t covered = 0;
    for (int64_t c = 0; c < num_classes_; ++c) {
      int64_t vol = 1;
      for (const Runs& r : class_piece(c)) vol = checked_mul(vol, total_len(r), "elements of a piece");
      covered = checked_add(covered, vol, "elements of all pieces");
    }
    if (covered != numel())
      error_ = detail::format("the pieces cover ", covered, " elements of ", numel());
  } catch (const ReshardError& e) {
    error_ = e.what();
  }
}

bool Layout::same_as(const Layout& o) const {
  return shape_ == o.shape_ && dtype_ == o.dtype_ && mesh_->same_as(*o.mesh_) && placements_ == o.placements_;
}

// The same text as reshard_ext.Layout's repr (Python uses this one).
std::string Layout::describe() const {
  std::string s = "Layout(shape=" + py_tuple(shape_) + ", dtype=torch." + dtype_name(dtype_) + ", mesh=" +
                  mesh_->describe() + ", placements=[";
  for (size_t i = 0; i < placements_.size(); ++i) {
    const Placement& p = placements_[i];
    s += i ? ", " : "";
    if (!p.is_shard()) {
      s += "Replicate()";
      continue;
    }
    s += detail::format("Shard(", p.shard_dim);
    if (p.stride != 1) s += detail::format(", stride=", p.stride);
    if (!p.blocks.empty()) s += ", blocks=" + py_tuple(p.blocks);
    if (!p.sizes.empty()) s += ", sizes=" + py_tuple(p.sizes);
    s += ")";
  }
  return s + "])";
}

namespace {

// Row-major (un)ravelling of an index over a subset of the mesh dims.
void unravel(int64_t index, const std::vector<int>& dims, const std::vector<int64_t>& ms, int64_t* coord) {
  for (int k = static_cast<int>(dims.size()) - 1; k >= 0; --k) {
    coord[dims[k]] = index % ms[dims[k]];
    index /= ms[dims[k]];
  }
}

int64_t ravel(const int64_t* coord, const std::vector<int>& dims, const std::vector<int64_t>& ms) {
  int64_t index = 0;
  for (int d : dims) index = index * ms[d] + coord[d];
  return index;
}

}  // namespace

int64_t Layout::class_of_position(int64_t pos) const {
  int64_t coord[16];
  unravel(pos, all_mesh_dims_, mesh_->shape(), coord);
  return ravel(coord, shard_mesh_dims_, mesh_->shape());
}

int64_t Layout::replica_of_position(int64_t pos) const {
  int64_t coord[16];
  unravel(pos, all_mesh_dims_, mesh_->shape(), coord);
  return ravel(coord, repl_mesh_dims_, mesh_->shape());
}

Piece Layout::class_piece(int64_t cls) const {
  const auto& ms = mesh_->shape();
  int64_t coord[16] = {0};
  unravel(cls, shard_mesh_dims_, ms, coord);
  Piece piece(shape_.size());
  for (size_t d = 0; d < shape_.size(); ++d) piece[d] = {Run{0, shape_[d]}};
  for (int d : shard_mesh_dims_) {
    const Placement& p = placements_[d];
    Runs& runs = piece[p.shard_dim];
    runs = select_local(runs, shard_ranges(total_len(runs), ms[d], coord[d], p));
  }
  return piece;
}

int32_t Layout::class_replica(int64_t cls, int64_t j) const {
  int64_t coord[16] = {0};
  unravel(cls, shard_mesh_dims_, mesh_->shape(), coord);
  unravel(j, repl_mesh_dims_, mesh_->shape(), coord);
  return mesh_->ranks()[ravel(coord, all_mesh_dims_, mesh_->shape())];
}

bool Layout::piece_of(int32_t rank, Piece* out) const {
  const int64_t pos = mesh_->position(rank);
  if (pos < 0) return false;
  *out = class_piece(class_of_position(pos));
  return true;
}

std::vector<int64_t> Layout::local_shape(const Piece& piece) const {
  std::vector<int64_t> s;
  for (const Runs& r : piece) s.push_back(total_len(r));
  return s;
}

}  // namespace rx
