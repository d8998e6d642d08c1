#include "comm/host_mailbox.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <utility>

#include "comm/process_alive.h"
#include "common/backoff.h"
#include "common/check.h"

namespace rx {
namespace {

constexpr uint64_t kMagic = 0x52584d4158424f58ull;  // "RXMAXBOX"
constexpr size_t kHead = 128;                       // segment header: see Head
// Words of the segment's head: the owner's process (comm/process_alive.h) and alarm word.
enum Head {
  kMagicWord, kSizeWord, kWordsWord, kPidWord, kPidNsWord, kStartWord, kAlarmWord, kAlarmLeftWord, kCurrentWord,
  kAttemptWord, kAlarmAttemptWord
};
// After the slots: the alarm's text, its length in the first word.
constexpr size_t kTextBytes = 8 + HostMailbox::kMaxAlarmText;

constexpr size_t kSlot = 128;                       // state word + kMaxWords header words

size_t segment_bytes(int32_t size) { return kHead + static_cast<size_t>(size) * kSlot + kTextBytes; }
constexpr uint64_t kPosted = 1, kTaken = 2, kWithdrawn = 3;

// Spinning this long after a poll starts costs less than one sleep's wake-up.
constexpr auto kSpin = std::chrono::microseconds(50);

uint64_t load(const uint64_t* w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }
bool cas(uint64_t* w, uint64_t expected, uint64_t desired) {
  return __atomic_compare_exchange_n(w, &expected, desired, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

}  // namespace

HostMailbox::HostMailbox(int32_t rank, int32_t size, int32_t words) : rank_(rank), size_(size), words_(words) {
  RX_HOST_ASSERT(size >= 1 && rank >= 0 && rank < size, "HostMailbox: rank ", rank, " of ", size);
  RX_HOST_ASSERT(words >= 1 && words <= kMaxWords, "HostMailbox: ", words, " header words");
  segment_ = ShmSegment::create(segment_bytes(size), false, "HostMailbox");
  auto* head = static_cast<uint64_t*>(segment_.base());  // zero-filled by ftruncate: every slot idle
  head[kSizeWord] = static_cast<uint64_t>(size);
  head[kWordsWord] = static_cast<uint64_t>(words);
  const ProcessId me = this_process();
  head[kPidWord] = static_cast<uint64_t>(me.pid);
  head[kPidNsWord] = me.pid_ns;
  head[kStartWord] = me.start;
  __atomic_store_n(&head[kMagicWord], kMagic, __ATOMIC_RELEASE);
  peers_.resize(static_cast<size_t>(size));
}

HostMailbox::~HostMailbox() = default;

void HostMailbox::attach(int32_t peer, const std::string& name) {
  RX_HOST_ASSERT(peer >= 0 && peer < size_ && peer != rank_, "HostMailbox: bad peer ", peer);
  if (peers_[static_cast<size_t>(peer)]) return;
  ShmSegment p = ShmSegment::open(name, segment_.bytes(),
                                  "rank " + std::to_string(peer) + "'s header mailbox (from rank " +
                                      std::to_string(rank_) + ")");
  const auto* head = static_cast<const uint64_t*>(p.base());
  RX_USER_CHECK(load(&head[kMagicWord]) == kMagic && head[kSizeWord] == static_cast<uint64_t>(size_) &&
                    head[kWordsWord] == static_cast<uint64_t>(words_),
                "HostMailbox: rank ", peer, "'s header mailbox ", name, " is not one of this group's");
  peers_[static_cast<size_t>(peer)] = std::move(p);
}

bool HostMailbox::attached(int32_t peer) const {
  return peer >= 0 && peer < size_ && static_cast<bool>(peers_[static_cast<size_t>(peer)]);
}

uint64_t* HostMailbox::mine(int32_t peer) const {
  return reinterpret_cast<uint64_t*>(static_cast<char*>(segment_.base()) + kHead + static_cast<size_t>(peer) * kSlot);
}

uint64_t* HostMailbox::theirs(int32_t peer) const {
  return reinterpret_cast<uint64_t*>(static_cast<char*>(peers_[static_cast<size_t>(peer)].base()) + kHead +
                                     static_cast<size_t>(rank_) * kSlot);
}

void HostMailbox::post(const std::vector<int32_t>& peers, const int64_t* header) {
  RX_HOST_ASSERT(pending_.empty(), "HostMailbox: an exchange is still open");
  for (int32_t p : peers) RX_HOST_ASSERT(attached(p), "HostMailbox: rank ", p, " is not attached");
  for (int32_t p : peers) {
    uint64_t* slot = mine(p);
    const uint64_t state = load(slot);
    RX_HOST_ASSERT((state & 3) != kPosted, "HostMailbox: a header to rank ", p, " is still posted");
    const uint64_t gen = (state >> 2) + 1;
    for (int32_t w = 0; w < words_; ++w)
      __atomic_store_n(reinterpret_cast<int64_t*>(slot + 1 + w), header[w], __ATOMIC_RELAXED);
    __atomic_store_n(slot, gen << 2 | kPosted, __ATOMIC_RELEASE);
    pending_.push_back(Pending{p, gen, false, false});
  }
  kind_ = header[0];
}

bool HostMailbox::try_take(Pending& p, int64_t* row) {
  uint64_t* slot = theirs(p.peer);
  const uint64_t state = load(slot);
  if ((state & 3) != kPosted) return false;
  for (int32_t w = 0; w < words_; ++w)
    row[w] = __atomic_load_n(reinterpret_cast<const int64_t*>(slot + 1 + w), __ATOMIC_RELAXED);
  if (row[0] != kind_ || apart(p.peer)) {  // another kind of exchange's, or another execute's: left for it
    std::fill(row, row + words_, int64_t{0});
    return false;
  }
  // Valid only if the slot still holds that post: a withdrawn and re-posted header fails the CAS.
  p.took = cas(slot, state, (state & ~uint64_t{3}) | kTaken);
  return p.took;
}

bool HostMailbox::apart(int32_t peer) const {
  const auto* own = static_cast<const uint64_t*>(segment_.base());
  const auto* their = static_cast<const uint64_t*>(peers_[static_cast<size_t>(peer)].base());
  const uint64_t here = load(own + kCurrentWord), there = load(their + kCurrentWord);
  if (here == there) return false;
  // the peer left this rank's execute, or this rank left the peer's (plan.abort() on one host)
  return (load(their + kAlarmWord) == here && load(their + kAlarmLeftWord) != 0) ||
         (load(own + kAlarmWord) == there && load(own + kAlarmLeftWord) != 0);
}

bool HostMailbox::step(int64_t* rows) {
  bool done = true;
  for (size_t i = 0; i < pending_.size(); ++i) {
    Pending& p = pending_[i];
    if (!p.took) try_take(p, rows + i * static_cast<size_t>(words_));
    if (!p.taken) p.taken = load(mine(p.peer)) == (p.gen << 2 | kTaken);
    done = done && p.took && p.taken;
  }
  return done;
}

bool HostMailbox::poll(double seconds, int64_t* rows) {
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double>(std::max(seconds, 0.0)));
  Backoff backoff(100);
  while (true) {
    if (step(rows)) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now >= until) return false;
    if (now - start < kSpin)
      cpu_relax();
    else
      backoff.pause();
  }
}

std::vector<int32_t> HostMailbox::finish(int64_t* rows) {
  std::vector<int32_t> out;
  step(rows);
  for (size_t i = 0; i < pending_.size(); ++i) {
    Pending& p = pending_[i];
    // A peer that took our header has posted its own (it posts before it takes).
    if (!p.taken && !cas(mine(p.peer), p.gen << 2 | kPosted, p.gen << 2 | kWithdrawn)) p.taken = true;
    if (p.taken && !p.took) try_take(p, rows + i * static_cast<size_t>(words_));
    out.push_back(p.took && p.taken ? 0 : (!p.took ? 1 : 2));
  }
  pending_.clear();
  return out;
}

std::vector<int32_t> HostMailbox::unfinished() const {
  std::vector<int32_t> out;
  for (const Pending& p : pending_)
    if (!(p.took && p.taken)) out.push_back(p.peer);
  return out;
}

void HostMailbox::raise_alarm(uint64_t token, uint64_t attempt, const std::string& text, bool left) {
  RX_HOST_ASSERT(token != 0, "HostMailbox: alarm token 0");
  auto* head = static_cast<uint64_t*>(segment_.base());
  // A reader copies between two reads of the alarm word and keeps the copy only if both
  // read its token: the word is 0 while the text changes.
  __atomic_store_n(head + kAlarmWord, uint64_t{0}, __ATOMIC_RELEASE);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  const size_t n = std::min(text.size(), kMaxAlarmText);
  char* area = static_cast<char*>(segment_.base()) + kHead + static_cast<size_t>(size_) * kSlot;
  __atomic_store_n(head + kAlarmLeftWord, uint64_t{left}, __ATOMIC_RELAXED);
  __atomic_store_n(head + kAlarmAttemptWord, attempt, __ATOMIC_RELAXED);
  __atomic_store_n(reinterpret_cast<uint64_t*>(area), static_cast<uint64_t>(n), __ATOMIC_RELAXED);
  std::memcpy(area + 8, text.data(), n);
  __atomic_store_n(head + kAlarmWord, token, __ATOMIC_RELEASE);
}

void HostMailbox::begin(uint64_t token, uint64_t attempt) {
  auto* head = static_cast<uint64_t*>(segment_.base());
  // An alarm of an earlier execute with another token stays: its peers may still read why.
  if (load(head + kAlarmWord) == token) {
    __atomic_store_n(head + kAlarmWord, uint64_t{0}, __ATOMIC_RELEASE);
    __atomic_store_n(head + kAlarmLeftWord, uint64_t{0}, __ATOMIC_RELEASE);
  }
  __atomic_store_n(head + kAttemptWord, attempt, __ATOMIC_RELEASE);  // before the token: read in that order
  __atomic_store_n(head + kCurrentWord, token, __ATOMIC_RELEASE);
}

std::vector<int32_t> HostMailbox::behind(const std::vector<int32_t>& peers, uint64_t token, uint64_t attempt) const {
  std::vector<int32_t> out;
  for (int32_t p : peers) {
    if (!attached(p)) continue;
    const auto* head = static_cast<const uint64_t*>(peers_[static_cast<size_t>(p)].base());
    if (load(head + kCurrentWord) == token && load(head + kAttemptWord) < attempt) out.push_back(p);
  }
  return out;
}

void HostMailbox::end() {
  __atomic_store_n(static_cast<uint64_t*>(segment_.base()) + kCurrentWord, uint64_t{0}, __ATOMIC_RELEASE);
}

bool HostMailbox::read_alarm(int32_t peer, uint64_t token, std::string* text, bool* left, uint64_t* attempt) const {
  if (!attached(peer)) return false;
  const char* base = static_cast<const char*>(peers_[static_cast<size_t>(peer)].base());
  const auto* head = reinterpret_cast<const uint64_t*>(base);
  if (load(head + kAlarmWord) != token) return false;
  const char* area = base + kHead + static_cast<size_t>(size_) * kSlot;
  const uint64_t n = std::min<uint64_t>(load(reinterpret_cast<const uint64_t*>(area)), kMaxAlarmText);
  std::string copy(area + 8, static_cast<size_t>(n));
  const bool was_left = load(head + kAlarmLeftWord) != 0;
  const uint64_t of_attempt = load(head + kAlarmAttemptWord);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (load(head + kAlarmWord) != token) return false;  // rewritten while we copied
  *text = std::move(copy);
  *left = was_left;
  *attempt = of_attempt;
  return true;
}

std::vector<int32_t> HostMailbox::alarmed(const std::vector<int32_t>& peers, uint64_t token) const {
  std::vector<int32_t> out;
  for (int32_t p : peers) {
    if (!attached(p)) continue;
    const auto* head = static_cast<const uint64_t*>(peers_[static_cast<size_t>(p)].base());
    // the execute first (begin() cleared the alarm before it set it), then the alarm
    const bool in_it = load(head + kCurrentWord) == token;
    if (load(head + kAlarmWord) == token && (in_it || load(head + kAlarmLeftWord) != 0)) out.push_back(p);
  }
  return out;
}

std::vector<int32_t> HostMailbox::gone(const std::vector<int32_t>& peers) const {
  std::vector<int32_t> out;
  for (int32_t p : peers) {
    if (!attached(p)) continue;
    const auto* head = static_cast<const uint64_t*>(peers_[static_cast<size_t>(p)].base());
    const ProcessId id{static_cast<int64_t>(head[kPidWord]), head[kPidNsWord], head[kStartWord]};
    if (process_gone(id)) out.push_back(p);
  }
  return out;
}

}  // namespace rx
