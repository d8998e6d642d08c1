// rx::Executor: the pipelined run of one bound plan on a GPU (DESIGN section 4). Per
// binding it owns the pack / unpack / copy descriptor tables (built from ExecTables, uploaded
// once), the verify digest tables and rounds (built by the first verified execute), and
// runs each execute's schedule: pack b + 1 before the transfer of b, the same-rank copy
// slice of b under transfer b, then landed -> unpack, on the caller's stream with the
// transfers on a high-priority side stream.
//
// The schedule talks to two interfaces: a Device (streams, events, table launches: CUDA,
// or a recorder that logs each call so CPU tests check the order) and a Transport (what
// moves the bytes: NCCL, NVSHMEM, or a recorder). Streams and events cross as opaque
// handles (cudaStream_t / cudaEvent_t on the GPU).
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/exec_tables.h"

namespace rx {

using StreamHandle = uint64_t;
using EventHandle = uint64_t;

// What carries the bytes of a batch between ranks.
class Transport {
 public:
  virtual ~Transport() = default;
  // Posts batch b's messages (round r of a verified execute, or -1: the whole batch) on
  // `side`. whole: they are every message of the batch (no peer left out, nothing redirected).
  virtual void post(int32_t batch, int32_t round, const std::vector<Message>& sends,
                    const std::vector<Message>& recvs, StreamHandle side, bool whole) = 0;
  // Orders `main` after batch b landed here; `done` marks the end of its post on the side stream.
  virtual void landed(int32_t batch, StreamHandle main, EventHandle done) = 0;
  // Batch b is unpacked on `main` (its staging may be reused by the senders).
  virtual void unpacked(int32_t /*batch*/, StreamHandle /*main*/) {}
  // Host wait, bounded, for every transfer of the execute; throws ReshardError.
  virtual void drain(StreamHandle main, StreamHandle side, double timeout_s) = 0;
  // Stops this rank's transfers at once; from any thread.
  virtual void abort() {}
  // Whether verified executes move direct receives in rounds (ExecTables::round_messages).
  virtual bool rounds() const { return false; }
};

// Streams, events and the table launches of the schedule.
class Device {
 public:
  virtual ~Device() = default;
  virtual void clear_tables() = 0;  // a new binding: the ids start over
  // Takes a table; returns its id. `name` labels it for recorders.
  virtual int32_t add_table(const std::vector<rx_box>& boxes, const std::string& name) = 0;
  virtual int64_t num_boxes(int32_t table) const = 0;
  // Device bytes the tables added since the last upload need; upload copies them into
  // `dev` (that many bytes, 256-aligned, owned by the caller) and waits for the copy.
  virtual int64_t pending_bytes() const = 0;
  virtual void upload(uint64_t dev, StreamHandle stream) = 0;
  // Copies every box of `table` on `s`; digest_slot >= 0: a verify pass `pass` adding
  // each box's digest into the digest buffer from that slot on.
  virtual void launch(int32_t table, StreamHandle s, int32_t max_blocks, int64_t digest_slot, int32_t pass) = 0;
  virtual void set_digests(uint64_t dev) = 0;  // one zeroed-per-execute uint64 per digest slot
  virtual void zero_digests(int64_t slots, StreamHandle s) = 0;
  virtual StreamHandle side() = 0;  // high priority
  // An event recorded on `s`, valid until the next begin(); timing: for the trace.
  virtual EventHandle record(StreamHandle s, bool timing) = 0;
  virtual void wait_event(StreamHandle s, EventHandle e) = 0;
  virtual void wait_stream(StreamHandle waiter, StreamHandle signaller) = 0;
  virtual void begin() = 0;  // a new execute: the events of the last one may be reused
  // Milliseconds from a to b, both timing events that completed (after sync_event(b)).
  virtual void sync_event(EventHandle e) = 0;
  virtual double elapsed_ms(EventHandle a, EventHandle b) = 0;
  // Device memory of `bytes` that stays until release_scratch, which first waits for `s`.
  virtual uint64_t scratch(int64_t bytes) = 0;
  virtual void release_scratch(StreamHandle s) = 0;
};

// One traced step of an execute: when it began and ended on its stream, in ms from the first.
struct TraceRow {
  std::string kind;
  int32_t batch;
  double begin_ms, end_ms;
};

class Executor {
 public:
  // The rounds a verified execute cuts its last batch into (every rank alike: num_batches
  // is agreed): enough that the last round, whose digest runs after every transfer, holds
  // at most an eighth of the bytes (assign_batches halves the last of 3 or more batches),
  // and no more: each round is one more transport post.
  static int32_t verify_rounds(int32_t num_batches) { return num_batches >= 3 ? 2 : num_batches == 2 ? 4 : 8; }

  explicit Executor(std::unique_ptr<Device> device);
  Device& device() { return *device_; }

  // Builds the tables of a binding (after ExecTables::bind). sliced: the same-rank
  // copies go in one slice per batch (pipelined runs); max_blocks: grid cap beside
  // transfers; recv_staging: [ptr, ptr + bytes) of each receive staging buffer.
  void prepare(std::shared_ptr<const ExecTables> tables, bool sliced, int32_t max_blocks,
               const std::vector<std::pair<uint64_t, int64_t>>& recv_staging);
  void set_transport(std::shared_ptr<Transport> transport) { transport_ = std::move(transport); }
  const std::shared_ptr<Transport>& transport() const { return transport_; }
  const std::vector<int32_t>& peers() const { return peers_; }
  int32_t num_batches() const { return static_cast<int32_t>(pack_.size()); }
  int32_t num_copy_slices() const { return static_cast<int32_t>(copy_.size()); }
  int32_t max_blocks() const { return max_blocks_; }
  // Grid cap of a verified execute's hashing kernels (0: none): hashing makes them
  // compute-bound, so the cap that leaves HBM to the transfers would make them the
  // pipeline's bottleneck. Its same-rank copies hash nothing and keep max_blocks.
  int32_t verify_max_blocks() const { return verify_max_blocks_; }
  void set_verify_max_blocks(int32_t blocks) { verify_max_blocks_ = blocks; }

  // Verify: the digest tables, built once (the caller uploads pending_bytes() and gives
  // a buffer of digest_slots() uint64 through set_digests); collect() scatters the
  // digests (host copy) into (send, recv) arrays indexed by op.
  int64_t build_verify();
  bool verify_built() const { return verify_built_; }
  int64_t digest_slots() const { return digest_slots_; }
  // Per digest slot: +1 where it holds a send op's digest, -1 a receive op's, 0 neither
  // (the lane sums of the check on the device: sends minus receives).
  std::vector<int64_t> digest_signs() const;
  std::pair<std::vector<uint64_t>, std::vector<uint64_t>> collect(const uint64_t* host, int64_t n) const;

  // An execute: begin, then the first pack (while the headers travel), then run.
  void begin(StreamHandle main, bool verify, bool trace);
  void pack_first();
  // The pipelined rest: transfers with the peers in `good`; writes: this rank writes
  // its destinations (else what arrives lands in scratch memory, staging aside).
  // defer_drain: return once everything is queued and leave the host wait for the
  // transfers to drain(), so that the caller can queue more GPU work first.
  void run(const std::vector<int32_t>& good, bool writes, double timeout_s, bool defer_drain = false);
  // The host wait that run(..., defer_drain=true) left (nothing otherwise); raises
  // ReshardError where a transfer failed or timed out.
  void drain();
  // Single steps for schedules kept in Python (torch.distributed p2p, copy-only plans).
  void pack(int32_t b);
  void digest_direct_sends(int32_t b);
  void copy(int32_t i);
  void unpack(int32_t b);
  // The steps traced since begin; waits for the last one.
  std::vector<TraceRow> timeline();
  // With time_host on, run() measures its host time: (posting and launching: thread CPU, wall;
  // the host wait for the transfers: thread CPU, wall) of the last run, in seconds
  // (benchmarks/host_overhead.py).
  void set_time_host(bool on) { time_host_ = on; }
  std::array<double, 4> last_run_times() const { return last_run_times_; }
  void abort();

  // Tests: called after each post with (batch, round, side stream, receives).
  using PostHook = std::function<void(int32_t, int32_t, StreamHandle, const std::vector<Message>&)>;
  void set_post_hook(PostHook hook) { post_hook_ = std::move(hook); }

 private:
  template <class F>
  void step(const std::string& kind, int32_t batch, StreamHandle s, F&& fn);
  void launch(int32_t table, int32_t cap, int32_t part, int32_t pass);
  void pack_step(int32_t b, int32_t cap);
  void unpack_step(int32_t b, int32_t cap);
  void digest_sends_step(int32_t b, int32_t cap);
  void post(int32_t b);
  void digest_direct_recvs(int32_t b);
  bool in_rounds(int32_t b) const;
  using Messages = std::pair<std::vector<Message>, std::vector<Message>>;  // (sends, recvs)
  // Batch b's messages (round r, or -1: all) with the peers of this execute.
  const Messages& messages(int32_t b, int32_t r, bool* whole);

  std::unique_ptr<Device> device_;
  std::shared_ptr<Transport> transport_;
  std::shared_ptr<const ExecTables> tables_;
  std::vector<int32_t> pack_, unpack_, copy_;  // table ids
  std::vector<Messages> messages_;  // per batch
  std::vector<std::pair<uint64_t, int64_t>> recv_staging_;
  std::vector<int32_t> peers_;
  int32_t max_blocks_ = 0, verify_max_blocks_ = 0;
  int32_t cap() const { return verify_ ? verify_max_blocks_ : max_blocks_; }  // this execute's
  // verify: per batch parts 4b..4b+3 (pack, direct sends, unpack, direct receives): table and first slot
  struct Part {
    int32_t table;
    int64_t slot;
    bool send;
    std::vector<int32_t> ops;
  };
  std::vector<Part> parts_;
  int64_t digest_slots_ = 0;
  bool verify_built_ = false;
  std::vector<std::vector<int32_t>> round_tables_;  // per batch: its direct receives per round (empty: none)
  std::vector<std::vector<Messages>> round_messages_;  // verify: per batch and round
  // this execute
  StreamHandle main_ = 0, side_ = 0;
  bool verify_ = false, trace_ = false, all_good_ = true;
  std::vector<int32_t> good_;
  std::vector<EventHandle> done_;
  std::vector<std::vector<EventHandle>> landed_;
  struct Mark {
    std::string kind;
    int32_t batch;
    EventHandle begin, end;
  };
  std::vector<Mark> marks_;
  bool scratch_ = false;
  bool drain_pending_ = false;  // run(..., defer_drain=true) has not been drained
  double drain_timeout_s_ = 0;
  Messages degraded_;  // messages() of a degraded execute, valid until its next call
  PostHook post_hook_;
  bool time_host_ = false;
  std::array<double, 4> last_run_times_{};
};

// The calls recorders were asked, in order.
struct RecordingLog {
  std::vector<std::string> lines;
};

// A device that runs nothing and logs every call ("main: pack 0", "side: record e3", ...):
// CPU tests check the schedule's order with it. Stream 1 is "main", 2 "side".
class RecordingDevice : public Device {
 public:
  explicit RecordingDevice(std::shared_ptr<RecordingLog> log) : log_(std::move(log)) {}
  void clear_tables() override {
    names_.clear();
    boxes_.clear();
  }
  int32_t add_table(const std::vector<rx_box>& boxes, const std::string& name) override;
  int64_t num_boxes(int32_t table) const override { return boxes_[static_cast<size_t>(table)]; }
  int64_t pending_bytes() const override { return 0; }
  void upload(uint64_t, StreamHandle) override {}
  void launch(int32_t table, StreamHandle s, int32_t max_blocks, int64_t digest_slot, int32_t pass) override;
  void set_digests(uint64_t) override {}
  void zero_digests(int64_t, StreamHandle) override {}
  StreamHandle side() override { return 2; }
  EventHandle record(StreamHandle s, bool timing) override;
  void wait_event(StreamHandle s, EventHandle e) override;
  void wait_stream(StreamHandle waiter, StreamHandle signaller) override;
  void begin() override { events_ = 0; }
  void sync_event(EventHandle) override {}
  double elapsed_ms(EventHandle a, EventHandle b) override;
  uint64_t scratch(int64_t bytes) override;
  void release_scratch(StreamHandle s) override;

  static std::string name(StreamHandle s) { return s == 1 ? "main" : s == 2 ? "side" : "stream?"; }

 private:
  std::shared_ptr<RecordingLog> log_;
  std::vector<std::string> names_;
  std::vector<int64_t> boxes_;
  std::vector<size_t> at_;  // per timing event: the log position it was recorded at
  int64_t events_ = 0;
  uint64_t next_scratch_ = uint64_t{1} << 56;
};

// A transport that moves nothing and logs what it is asked ("side: post 0 sends [(1, 8)]"),
// keeping the receives it was given (tests). fail_drain: drain throws that ReshardError.
class RecordingTransport : public Transport {
 public:
  explicit RecordingTransport(std::shared_ptr<RecordingLog> log, bool rounds = false)
      : log_(std::move(log)), rounds_(rounds) {}
  void post(int32_t batch, int32_t round, const std::vector<Message>& sends, const std::vector<Message>& recvs,
            StreamHandle side, bool whole) override;
  void landed(int32_t batch, StreamHandle main, EventHandle done) override;
  void drain(StreamHandle main, StreamHandle side, double timeout_s) override;
  bool rounds() const override { return rounds_; }
  std::vector<Message> received;
  std::string fail_drain;

 private:
  std::shared_ptr<RecordingLog> log_;
  bool rounds_;
};

// A device that runs each launch at once on the host through the kernels' CPU twins (the
// tables point at host memory); streams and events are no-ops. With HostFabric, CPU tests
// run the executor's whole data path, verify digests included.
class HostDevice : public Device {
 public:
  void clear_tables() override { tables_.clear(); }
  int32_t add_table(const std::vector<rx_box>& boxes, const std::string& name) override;
  int64_t num_boxes(int32_t table) const override {
    return static_cast<int64_t>(tables_[static_cast<size_t>(table)].size());
  }
  int64_t pending_bytes() const override { return 0; }
  void upload(uint64_t, StreamHandle) override {}
  void launch(int32_t table, StreamHandle s, int32_t max_blocks, int64_t digest_slot, int32_t pass) override;
  void set_digests(uint64_t host) override { digests_ = reinterpret_cast<uint64_t*>(host); }
  void zero_digests(int64_t slots, StreamHandle s) override;
  StreamHandle side() override { return 2; }
  EventHandle record(StreamHandle, bool) override { return ++events_; }
  void wait_event(StreamHandle, EventHandle) override {}
  void wait_stream(StreamHandle, StreamHandle) override {}
  void begin() override { events_ = 0; }
  void sync_event(EventHandle) override {}
  double elapsed_ms(EventHandle, EventHandle) override { return 0.0; }
  uint64_t scratch(int64_t bytes) override;
  void release_scratch(StreamHandle) override { scratch_.clear(); }

 private:
  std::vector<std::vector<rx_box>> tables_;
  uint64_t* digests_ = nullptr;
  EventHandle events_ = 0;
  std::vector<std::vector<char>> scratch_;
};

// In-process point-to-point between the host transports of one fabric (one per rank, each
// used from its own thread): a post copies its sends out, then waits for its receives,
// matched per pair in post order (as NCCL matches them).
class HostFabric : public std::enable_shared_from_this<HostFabric> {
 public:
  explicit HostFabric(int world) : world_(world) {}
  // rounds: the transport moves verified batches in rounds (as NCCL's does).
  std::shared_ptr<Transport> transport(int rank, bool rounds, double timeout_s);

  void put(int from, int to, const Message& m);
  void take(int from, int to, const Message& m, double timeout_s);  // throws ReshardError

 private:
  int world_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<int, int>, std::deque<std::vector<char>>> queues_;
};

#ifdef RX_WITH_CUDA
// The CUDA device: DeviceBoxTables in caller-owned device memory, a high-priority side
// stream, and pools of events reused from one execute to the next.
std::unique_ptr<Device> make_cuda_device(int device);
class NvshmemExchange;
std::shared_ptr<Transport> make_nvshmem_transport(std::shared_ptr<NvshmemExchange> puts);
#endif
#ifdef RX_WITH_NCCL
class NcclComm;
std::shared_ptr<Transport> make_nccl_transport(std::shared_ptr<NcclComm> comm);
#endif

}  // namespace rx
