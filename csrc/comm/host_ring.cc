#include "comm/host_ring.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "common/backoff.h"
#include "common/check.h"
#include "common/dtype.h"
#include "kernels/digest.h"

namespace rx {
namespace {

constexpr uint64_t kMagic = 0x5258524e47424f58ull;  // "RXRNGBOX"
constexpr size_t kHead = 64;                        // magic, locals, slots, slot bytes, locals' hash
constexpr size_t kLine = 64;                        // head and tail each on a cache line of their own
constexpr size_t kSlotHead = 64;                    // token, stream number, bytes
// Chunks end inside a message only this many bytes from its start, so every chunk holds
// whole elements of it at both ends (which may hash it), whatever the messages before it.
constexpr int64_t kCut = 16;

// Spinning this long after the last progress costs less than a sleep's wake-up; past it
// the loop sleeps, which leaves the core to the peer on a machine with few of them.
constexpr auto kSpin = std::chrono::microseconds(30);

struct SlotHead {
  uint64_t token;
  uint32_t number;
  uint32_t bytes;
};

uint64_t load(const uint64_t* w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }
void store(uint64_t* w, uint64_t v) { __atomic_store_n(w, v, __ATOMIC_RELEASE); }

uint64_t hash_of(const std::vector<int32_t>& v) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t x : v) h = (h ^ static_cast<uint32_t>(x)) * 0x100000001b3ull;
  return h;
}

}  // namespace

HostRing::HostRing(int32_t rank, std::vector<int32_t> locals, int32_t slots, int64_t slot_bytes)
    : rank_(rank), slots_(slots), slot_bytes_(slot_bytes), locals_(std::move(locals)) {
  RX_HOST_ASSERT(std::is_sorted(locals_.begin(), locals_.end()) &&
                     std::adjacent_find(locals_.begin(), locals_.end()) == locals_.end() && index_of(rank) >= 0,
                 "HostRing: the host's ranks must be sorted, distinct and hold rank ", rank);
  RX_HOST_ASSERT(slots >= 2 && slot_bytes >= 4096 && slot_bytes % 64 == 0 && slot_bytes <= (int64_t{1} << 30),
                 "HostRing: ", slots, " slots of ", slot_bytes, " bytes");
  ring_bytes_ = 2 * kLine + static_cast<size_t>(slots) * (kSlotHead + static_cast<size_t>(slot_bytes));
  segment_ = ShmSegment::create(kHead + locals_.size() * ring_bytes_, true, "HostRing");
  auto* head = static_cast<uint64_t*>(segment_.base());
  head[1] = locals_.size();
  head[2] = static_cast<uint64_t>(slots);
  head[3] = static_cast<uint64_t>(slot_bytes);
  head[4] = hash_of(locals_);
  store(&head[0], kMagic);
  peers_.resize(locals_.size());
  sent_.assign(locals_.size(), 0);
  received_.assign(locals_.size(), 0);
}

int32_t HostRing::index_of(int32_t rank) const {
  const auto it = std::lower_bound(locals_.begin(), locals_.end(), rank);
  return it != locals_.end() && *it == rank ? static_cast<int32_t>(it - locals_.begin()) : -1;
}

void HostRing::attach(int32_t peer, const std::string& name) {
  const int32_t i = index_of(peer);
  RX_HOST_ASSERT(i >= 0 && peer != rank_, "HostRing: rank ", peer, " is not another rank of this host");
  if (peers_[static_cast<size_t>(i)]) return;
  ShmSegment p = ShmSegment::open(name, segment_.bytes(),
                                  "rank " + std::to_string(peer) + "'s data rings (from rank " + std::to_string(rank_) +
                                      ")");
  const auto* head = static_cast<const uint64_t*>(p.base());
  const auto* mine = static_cast<const uint64_t*>(segment_.base());
  RX_USER_CHECK(load(&head[0]) == kMagic && std::equal(head + 1, head + 5, mine + 1), "HostRing: rank ", peer,
                "'s data rings ", name, " are not laid out as rank ", rank_, "'s (another group, or other ranks)");
  peers_[static_cast<size_t>(i)] = std::move(p);
}

bool HostRing::attached(int32_t peer) const {
  const int32_t i = index_of(peer);
  return i >= 0 && static_cast<bool>(peers_[static_cast<size_t>(i)]);
}

HostRing::Ring HostRing::ring(char* segment, int32_t sender) const {
  char* r = segment + kHead + static_cast<size_t>(index_of(sender)) * ring_bytes_;
  return Ring{reinterpret_cast<uint64_t*>(r), reinterpret_cast<uint64_t*>(r + kLine), r + 2 * kLine};
}

char* HostRing::slot(const Ring& r, uint64_t n) const {
  return r.slots + static_cast<size_t>(n % static_cast<uint64_t>(slots_)) * (kSlotHead + static_cast<size_t>(slot_bytes_));
}

void HostRing::begin(uint64_t token, const std::vector<Piece>& sends, const std::vector<Piece>& recvs,
                     std::vector<Digest> digests) {
  RX_HOST_ASSERT(!open_, "HostRing: an exchange is still open");
  if (token != token_) {
    token_ = token;
    std::fill(sent_.begin(), sent_.end(), 0);
    std::fill(received_.begin(), received_.end(), 0);
  }
  digests_ = std::move(digests);
  streams_.clear();
  for (const bool send : {true, false}) {
    for (const Piece& p : send ? sends : recvs) {
      RX_HOST_ASSERT(attached(p.peer), "HostRing: rank ", p.peer, " is not attached");
      RX_HOST_ASSERT(p.bytes >= 0 && p.digest < static_cast<int32_t>(digests_.size()), "HostRing: bad piece");
      if (p.bytes == 0) continue;
      auto it = std::find_if(streams_.begin(), streams_.end(),
                             [&](const Stream& s) { return s.peer == p.peer && s.send == send; });
      if (it == streams_.end()) {
        const size_t i = static_cast<size_t>(index_of(p.peer));
        Stream s;
        s.peer = p.peer;
        s.send = send;
        s.number = send ? sent_[i]++ : received_[i]++;
        s.ring = send ? ring(static_cast<char*>(peers_[i].base()), rank_)
                      : ring(static_cast<char*>(segment_.base()), p.peer);
        streams_.push_back(std::move(s));
        it = streams_.end() - 1;
      }
      it->pieces.push_back(p);
      it->left += p.bytes;
    }
  }
  open_ = true;
}

void HostRing::copy_hashed(const Piece& p, int64_t off, int64_t n, char* slot, bool send) {
  const Digest& d = digests_[static_cast<size_t>(p.digest)];
  rx_box b = d.box;
  const int64_t es = dtype_size(b.dst_dtype);
  // a direct message moves its tensor's bytes as they are (ExecTables' flat condition)
  RX_HOST_ASSERT(b.ndim == 1 && b.src_dtype == b.dst_dtype && off % es == 0 && n % es == 0,
                 "HostRing: a verified message is not a 1-D same-dtype copy");
  const uint64_t piece = p.ptr + static_cast<uint64_t>(off);
  b.src = send ? piece : reinterpret_cast<uint64_t>(slot);
  b.dst = send ? reinterpret_cast<uint64_t>(slot) : piece;
  b.shape[0] = n / es;
  b.param[0] += off / es;
  uint64_t v = 0;
  // into a slot: in cache for the receiver; out of one: into a tensor, past the cache
  RX_HOST_ASSERT(rx_digest_boxes_cpu(&b, 1, send ? RX_PASS_COPY : RX_PASS_COPY_COLD, &v) == 0,
                 "HostRing: bad digest box");
  *d.out = digest::add(*d.out, v);
}

int64_t HostRing::move(Stream& s, char* data, int64_t n) {
  int64_t done = 0;
  while (done < n && s.left > 0) {
    const Piece& p = s.pieces[s.at];
    int64_t take = std::min(n - done, p.bytes - s.off);
    if (s.send && take < p.bytes - s.off) {  // a cut inside a message: at a multiple of kCut from its start
      take -= take % kCut;
      if (take == 0) break;  // the chunk ends short
    }
    char* piece = reinterpret_cast<char*>(p.ptr) + s.off;
    char* slot = data + done;
    if (p.digest >= 0)  // what leaves or what lands, hashed as it is copied
      copy_hashed(p, s.off, take, slot, s.send);
    else
      std::memcpy(s.send ? slot : piece, s.send ? piece : slot, static_cast<size_t>(take));
    done += take;
    s.off += take;
    s.left -= take;
    if (s.off == p.bytes) {
      ++s.at;
      s.off = 0;
    }
  }
  return done;
}

bool HostRing::step_send(Stream& s) {
  bool moved = false;
  uint64_t head = load(s.ring.head);  // ours alone: the last value we stored
  while (s.left > 0) {
    if (head - load(s.ring.tail) >= static_cast<uint64_t>(slots_)) break;
    char* at = slot(s.ring, head);
    char* data = at + kSlotHead;
    const int64_t n = move(s, data, slot_bytes_);
    auto* h = reinterpret_cast<SlotHead*>(at);
    h->token = token_;
    h->number = s.number;
    h->bytes = static_cast<uint32_t>(n);
    store(s.ring.head, ++head);
    moved = true;
  }
  return moved;
}

bool HostRing::step_recv(Stream& s) {
  bool moved = false;
  uint64_t tail = load(s.ring.tail);  // ours alone
  while (s.left > 0 && tail != load(s.ring.head)) {
    const char* at = slot(s.ring, tail);
    const auto* h = reinterpret_cast<const SlotHead*>(at);
    if (h->token != token_) {  // an earlier execute's leftover
      store(s.ring.tail, ++tail);
      moved = true;
      continue;
    }
    if (h->number != s.number || static_cast<int64_t>(h->bytes) > s.left) {
      s.error = "its data does not match this execute's messages (chunk of stream " + std::to_string(h->number) +
                ", " + std::to_string(h->bytes) + " bytes; expected stream " + std::to_string(s.number) + ", " +
                std::to_string(s.left) + " bytes left)";
      break;
    }
    move(s, const_cast<char*>(at) + kSlotHead, h->bytes);
    store(s.ring.tail, ++tail);
    moved = true;
  }
  return moved;
}

bool HostRing::poll(double seconds) {
  RX_HOST_ASSERT(open_, "HostRing: poll without an exchange");
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double>(std::max(seconds, 0.0)));
  auto last = start;
  Backoff backoff(100);
  while (true) {
    bool done = true, moved = false;
    for (Stream& s : streams_) {
      if (s.finished()) continue;
      moved = (s.send ? step_send(s) : step_recv(s)) || moved;
      done = done && s.finished();
    }
    if (done) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now >= until) return false;
    if (moved) {
      last = now;
      backoff.reset();
    } else if (now - last < kSpin) {
      cpu_relax();
    } else {
      backoff.pause();
    }
  }
}

std::vector<std::pair<int32_t, std::string>> HostRing::unfinished() const {
  std::vector<std::pair<int32_t, std::string>> out;
  for (const Stream& s : streams_) {
    if (s.left == 0) continue;
    auto it = std::find_if(out.begin(), out.end(), [&](const auto& e) { return e.first == s.peer; });
    if (it == out.end()) {
      out.emplace_back(s.peer, s.error);
    } else if (it->second.empty()) {
      it->second = s.error;
    }
  }
  return out;
}

void HostRing::end() {
  streams_.clear();
  digests_.clear();
  open_ = false;
}

}  // namespace rx
