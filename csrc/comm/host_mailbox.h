// Execute headers between the processes of one host through shared memory, so that no
// round trip through worker threads delays an execute's first GPU work (RESULTS.md).
//
// Each rank owns one POSIX shared-memory segment with a slot per receiving rank; a peer
// maps it and takes its slot. A slot's state word is (generation << 2) | state:
//   POSTED    the owner posted a header for this exchange and waits;
//   TAKEN     the receiver took it (a compare-and-swap from POSTED);
//   WITHDRAWN the owner gave up before anyone took it (a compare-and-swap from POSTED).
// Each end posts before it takes, and a pair's exchange succeeds at an end iff it took
// the peer's header and the peer took its own. Both CASes on a slot race only with each
// other, so the two ends always reach the same outcome: an end that gives up withdraws
// its header, and a peer that took it first has posted its own, which the end then takes.
// A dead peer never takes: the pair fails at the deadline, as with gloo, unless the waiting
// end asks first whether the peer's process is gone (`gone`: the segment's head names it).
//
// The head also holds the owner's alarm word: the token of the execute it failed in. Peers
// read it while they wait (`alarmed`), so a failure anywhere stops the others at once
// instead of at their timeout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/shm_segment.h"

namespace rx {

class HostMailbox {
 public:
  static constexpr int32_t kMaxWords = 15;  // header words per slot (a slot is 128 bytes)

  // Creates this rank's segment (`size` slots of `words` int64 each).
  HostMailbox(int32_t rank, int32_t size, int32_t words);
  ~HostMailbox();
  HostMailbox(const HostMailbox&) = delete;
  HostMailbox& operator=(const HostMailbox&) = delete;

  const std::string& name() const { return segment_.name(); }
  int32_t words() const { return words_; }
  size_t pending() const { return pending_.size(); }  // peers of the open exchange

  // Maps peer's segment (by its name()); throws ReshardError where it cannot.
  void attach(int32_t peer, const std::string& name);
  bool attached(int32_t peer) const;

  // One exchange with `peers` (attached, distinct, not this rank): posts `header` to each.
  void post(const std::vector<int32_t>& peers, const int64_t* header);
  // Takes what the peers posted into rows (one row of `words` per peer, in post order) and
  // waits for them to take ours, for at most `seconds`; true once every pair is done. Only
  // rows whose first word is ours (the kind of exchange: execute headers, outcome rows) are
  // taken: a peer already in the next kind of exchange keeps its row posted for it.
  bool poll(double seconds, int64_t* rows);
  // Ends the exchange: withdraws what no peer took. Returns, per peer in post order, 0
  // where the pair succeeded, 1 where the peer posted nothing, 2 where it took nothing.
  std::vector<int32_t> finish(int64_t* rows);
  // The peers of the open exchange whose pair is not done yet.
  std::vector<int32_t> unfinished() const;

  static constexpr size_t kMaxAlarmText = 1000;  // bytes of an alarm's text (longer is cut)

  // Sets this rank's alarm to `token` (never 0, the execute it failed in) and `attempt`
  // (which call with that token: a retry keeps it) with why, and whether it left that
  // execute without its final exchange (plan.abort()).
  void raise_alarm(uint64_t token, uint64_t attempt, const std::string& text, bool left);
  // The execute this rank is in (0: none). An execute begins by clearing an alarm of its
  // own token (left over from an earlier execute with the same number, one that did not
  // count), then setting this: an alarm with the token of the execute its owner is in is of
  // that execute.
  // attempt: how many calls with this token this rank made before that did not count (a
  // failed execute keeps its number, so its retry has the same token).
  void begin(uint64_t token, uint64_t attempt = 0);
  void end();
  // The attached peers among `peers` still in an earlier attempt of the execute of `token`
  // (one that this rank's failed call gave up on and that outlived it).
  std::vector<int32_t> behind(const std::vector<int32_t>& peers, uint64_t token, uint64_t attempt) const;
  // The attached peers among `peers` whose alarm holds `token` and who are in that execute
  // (or left it: plan.abort()).
  std::vector<int32_t> alarmed(const std::vector<int32_t>& peers, uint64_t token) const;
  // Peer's alarm text, left flag and attempt if its alarm holds `token` (a consistent
  // copy), else false.
  bool read_alarm(int32_t peer, uint64_t token, std::string* text, bool* left, uint64_t* attempt) const;
  // The attached peers among `peers` whose process has exited (comm/process_alive.h).
  std::vector<int32_t> gone(const std::vector<int32_t>& peers) const;

 private:
  struct Pending {
    int32_t peer;
    uint64_t gen;  // of our post
    bool took;     // we took the peer's header
    bool taken;    // the peer took ours
  };
  int64_t kind_ = 0;  // the first word of our posted rows: what we take
  uint64_t* mine(int32_t peer) const;    // our slot for peer's headers
  uint64_t* theirs(int32_t peer) const;  // peer's slot for ours
  bool try_take(Pending& p, int64_t* row);
  // Whether the peer is in another execute than this rank and one of the two left the
  // other's (plan.abort() on one host): a rank that left execute N may already post rows of
  // N + 1 while the others still exchange N's, and neither may take the other's as its own.
  bool apart(int32_t peer) const;
  bool step(int64_t* rows);  // one pass over the pending pairs; true when all are done

  int32_t rank_, size_, words_;
  ShmSegment segment_;             // ours
  std::vector<ShmSegment> peers_;  // mapped peer segments (empty: not attached)
  std::vector<Pending> pending_;   // the exchange in progress
};

}  // namespace rx
