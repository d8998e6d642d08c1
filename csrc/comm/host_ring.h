// The CPU transport's bytes between the processes of one host, through shared memory
// instead of gloo's TCP loopback: both copies of a chunk stay in the caches, and a
// verified execute hashes each chunk there as it copies it (rx.execute(verify=True)).
//
// Each rank owns one segment with an inbound ring per rank of its host (`locals`: the same
// sorted list at every rank of the host); a sender maps the receiver's segment and writes
// its ring there. A ring has `slots` slots of `slot_bytes`, a head (chunks written: the
// sender's) and a tail (chunks consumed: the receiver's). Both only grow, so neither end
// ever resets the other's state.
//
// An exchange moves, per peer and direction, a stream: that pair's messages back to back,
// cut into chunks that never span two exchanges and that cut a message only at a multiple
// of 16 bytes from its start (whole elements, for the hashes of a verified execute). Each chunk carries the execute's token and
// the pair's stream number within the execute. A receiver skips chunks of another token
// (left by an aborted or failed earlier execute: the channel drains that execute before a
// new one starts, so none is still being written), and fails the pair on a chunk it cannot
// place rather than land it in the wrong place. A dead or stuck peer leaves its streams
// unfinished: the caller's deadline decides, as with gloo.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/shm_segment.h"
#include "kernels/api.h"

namespace rx {

class HostRing {
 public:
  // One message of an exchange: `bytes` at `ptr`, to or from `peer`. digest >= 0: hash it
  // while copying, with the box of begin()'s `digests[digest]`.
  struct Piece {
    int32_t peer;
    uint64_t ptr;
    int64_t bytes;
    int32_t digest = -1;
  };
  // A verified message: its op's box (1-D, plain copy, first ordinal in param[0]) and
  // where its digest adds up (rx_digest_boxes_cpu's values, digest::add).
  struct Digest {
    rx_box box;
    uint64_t* out;
  };

  // Creates this rank's segment: an inbound ring for each rank of `locals` (sorted, holds
  // `rank`), its pages reserved (a full /dev/shm raises here, not later).
  HostRing(int32_t rank, std::vector<int32_t> locals, int32_t slots, int64_t slot_bytes);

  const std::string& name() const { return segment_.name(); }
  // Maps peer's segment (by its name()); ReshardError where it cannot.
  void attach(int32_t peer, const std::string& name);
  bool attached(int32_t peer) const;

  // Starts an exchange (none open): sends and recvs in stream order per peer; token: the
  // execute's (a new one restarts the pairs' stream numbers). Peers must be attached.
  void begin(uint64_t token, const std::vector<Piece>& sends, const std::vector<Piece>& recvs,
             std::vector<Digest> digests);
  // Moves what it can for at most `seconds`; true once every stream is done or failed.
  bool poll(double seconds);
  // Peers whose streams are not done, with why ("" for streams that are merely unfinished).
  std::vector<std::pair<int32_t, std::string>> unfinished() const;
  void end();  // closes the exchange, whatever its state
  bool open() const { return open_; }

 private:
  struct Ring {
    uint64_t* head;
    uint64_t* tail;
    char* slots;
  };
  struct Stream {
    int32_t peer;
    bool send;
    uint32_t number;  // the pair's stream number in this execute
    Ring ring;
    std::vector<Piece> pieces;
    size_t at = 0;    // piece in progress
    int64_t off = 0;  // bytes of it done
    int64_t left = 0;
    std::string error;
    bool finished() const { return left == 0 || !error.empty(); }
  };
  int32_t index_of(int32_t rank) const;  // in locals_, or -1
  Ring ring(char* segment, int32_t sender) const;
  char* slot(const Ring& r, uint64_t n) const;
  // Copies n bytes of verified piece p (from byte off) into the slot (send) or out of it,
  // and adds their digest to its op's.
  void copy_hashed(const Piece& p, int64_t off, int64_t n, char* slot, bool send);
  // Copies up to n bytes between a slot's data and the stream's next pieces (into the slot
  // when sending, out of it when receiving), hashing verified pieces; returns the bytes.
  int64_t move(Stream& s, char* data, int64_t n);
  bool step_send(Stream& s);
  bool step_recv(Stream& s);

  int32_t rank_, slots_;
  int64_t slot_bytes_;
  size_t ring_bytes_;
  std::vector<int32_t> locals_;
  ShmSegment segment_;
  std::vector<ShmSegment> peers_;  // by index in locals_
  uint64_t token_ = 0;
  std::vector<uint32_t> sent_, received_;  // streams of the current token, by index in locals_
  std::vector<Stream> streams_;
  std::vector<Digest> digests_;
  bool open_ = false;
};

}  // namespace rx
