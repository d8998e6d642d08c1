// The direct transport (DESIGN section 4, "Direct path"): on one host, a sender writes
// each box straight into the receiver's destination tensor through a CUDA IPC mapping.
// No staging at either end, no unpack; large 2-D boxes go through the copy engines, the
// rest through one launch of the box kernel (stores into peer memory), except a sender's
// codec boxes: the box kernel writes them into a local staging ring and the copy engines
// carry them on, chunk by chunk (core/direct.h, plan_staging and stage_script).
//
// Each execute n of a plan, on every rank that takes part in a direct pair:
//   1. as a receiver, its stream stores "ready = n" into its own shared page: from that
//      point of the caller's stream its destinations are idle (the refit's contract:
//      nothing else reads or writes them until execute returns);
//   2. its same-rank copies (when it runs them) start at once, on a copy engine and its
//      kernel; as a sender, its host waits (bounded) until each receiver's page says
//      ready >= n, then enqueues its copies (batched calls) and kernel on side streams
//      after the work already on the caller's stream (the sources are ready), and then
//      stores "done = landed_word(n)" into each receiver's flag word (in the receiver's
//      GPU memory, through IPC); a verified execute writes and signals the landing groups
//      of core/direct.h one by one, so that the receiver's digests follow the writes;
//   3. as a receiver, its stream waits (a bounded spin kernel) until every sender's word
//      says the execute landed; the caller's stream waits for its own sends; the host
//      waits for that point (bounded) and raises if a peer never signalled.
// So completion reaches the receiver on the GPU, and the only host waits are one at the
// start (senders) and one at the end, per execute; a dead or missing peer raises a
// ReshardError naming it within the timeout instead of hanging. After any failure the
// plan's direct transport is unusable (its ranks no longer agree on the sequence).
#pragma once

#ifdef RX_WITH_CUDA

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/executor.h"
#include "comm/peer_map.h"
#include "core/direct.h"
#include "kernels/device_table.h"

namespace rx {

// One plan's signal words on one rank: a flag word per peer in GPU memory (written by
// senders through IPC), and a shared host page holding this rank's "ready" word (written
// by its GPU, read by its senders' hosts) and the error word of its waits.
class DirectSignals {
 public:
  // timeout_s bounds the wait for its zeroed signal words (zero_bounded).
  DirectSignals(int rank, int world, int device, double timeout_s);
  ~DirectSignals();
  DirectSignals(const DirectSignals&) = delete;
  DirectSignals& operator=(const DirectSignals&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  int device() const { return device_; }
  // What a peer needs to attach: the flags' IPC export and the page's path.
  const IpcExport& flags_export() const { return flags_export_; }
  const std::string& page_path() const { return page_->path(); }
  // Removes the page's file once every peer has attached (the mappings stay).
  void unlink_page() { page_->unlink(); }

  // Maps a peer's flags and page; "" or why not (the pair then uses NCCL).
  std::string attach(int peer, const IpcExport& flags, const std::string& page_path);
  bool attached(int peer) const { return peers_.count(peer) > 0; }

  uint64_t next_seq() { return ++seq_; }
  uint64_t seq() const { return seq_; }

  // Device addresses (this process): peer's flag word for this rank, this rank's flag
  // word for `peer`, this rank's ready and error words.
  uint64_t peer_flag(int peer) const;
  uint64_t own_flag(int peer) const;
  uint64_t ready_device() const { return page_->device_address(); }
  uint64_t error_device() const { return page_->device_address() + sizeof(uint64_t); }
  // Host views: a peer's ready word; this rank's error word.
  uint64_t peer_ready(int peer) const;
  volatile uint64_t* error_host() const { return page_->words() + 1; }

 private:
  struct Peer {
    std::unique_ptr<IpcMapping> flags;
    uint64_t flags_offset = 0;
    std::unique_ptr<SharedPage> page;
  };
  int rank_, world_, device_;
  uint64_t* flags_ = nullptr;  // world words, cudaMalloc'd here: see the constructor
  IpcExport flags_export_;
  std::unique_ptr<SharedPage> page_;
  std::map<int, Peer> peers_;
  uint64_t seq_ = 0;
};

// Copy-engine copies prepared once (at bind time) for one stream: issue() only submits
// them, one batched call per kind (cudaMemcpyBatchAsync for runs, cudaMemcpy3DBatchAsync
// for pitched copies) where the CUDA runtime and driver have it (12.8+), else (or once a
// batched call is refused) one call per copy.
class EngineQueue {
 public:
  EngineQueue() = default;
  EngineQueue(const std::vector<EngineCopy>& copies, bool batch);
  void issue(cudaStream_t stream);
  int64_t num_copies() const { return static_cast<int64_t>(runs_.size() + pitched_.size()); }
  // "batched", "per copy", or "per copy (why the batched calls are not used)".
  const std::string& mode() const { return mode_; }

 private:
  void issue_each(cudaStream_t stream);
  cudaError_t issue_batched(cudaStream_t stream);
  std::vector<EngineCopy> runs_, pitched_;
  bool batch_ = false;
  std::string mode_ = "per copy";
  // The batched calls' arguments, built once.
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<size_t> sizes_;
  std::vector<char> ops3d_;  // cudaMemcpy3DBatchOp records (opaque here: the header is CUDA 12.8+)
};

// How DirectExec carries its boxes (rx.Options fields of the direct transport).
struct DirectConfig {
  int64_t engine_bytes = 0;        // split_engines threshold of the boxes written into peers (0: kernel only)
  int64_t local_engine_bytes = 0;  // ... of the same-rank copies it runs (0: kernel only)
  int32_t local_blocks = 0;        // grid cap of the same-rank kernel (0: none)
  int32_t engine_streams = 0;      // streams the peer copy-engine copies are spread over (spread_engines; 0: auto)
  bool batch = true;               // batched copy-engine calls where available
  int32_t landing_groups = 1;      // groups a verified execute lands in (core/direct.h); alike on every rank
  int64_t stage_slot_bytes = 0;    // staging slot of a sender's codec boxes (plan_staging; 0: none staged)
  int32_t stage_slots = kStageSlots;    // slots of its ring (plan_staging)
  int32_t stage_streams = kStageStreams;  // copy-engine streams carrying its chunks (stage_script)
};

// One bound plan's direct work on one rank: the sends as copy-engine copies and a box
// kernel table, the same-rank copies when it is given them (a rank with no NCCL pair:
// then nothing else runs beside the direct writes), and the pairs to signal. Built at
// bind time; begin/end per execute.
class DirectExec {
 public:
  // boxes: every direct send's box (addresses in this process); local: same-rank copies
  // to run beside them (may be empty). receivers / senders: the peers this rank writes to
  // / that write to it directly, all attached in `signals`. box_groups: the landing group
  // of each box (landing_groups; empty: every box in group 0). box_stageable: whether each
  // box may be staged (ExecTables::direct_stageable; empty: none). box_ordinals: each box's
  // first verify ordinal in its op (ExecTables::direct_ordinals; empty: 0), for the staged
  // boxes' send digests.
  DirectExec(std::shared_ptr<DirectSignals> signals, const std::vector<rx_box>& boxes,
             const std::vector<rx_box>& local, const DirectConfig& config, std::vector<int32_t> receivers,
             std::vector<int32_t> senders, double timeout_s, const std::vector<int32_t>& box_groups = {},
             const std::vector<uint8_t>& box_stageable = {}, const std::vector<int64_t>& box_ordinals = {});
  ~DirectExec();
  DirectExec(const DirectExec&) = delete;
  DirectExec& operator=(const DirectExec&) = delete;

  // The kernels' box tables: bytes of device memory upload() fills (16-byte aligned).
  int64_t table_bytes() const;
  // Bytes of the staging ring upload() takes (0: no box is staged).
  int64_t staging_bytes() const { return staging_.ring_bytes(); }
  // Fills `dev` with the tables and binds the staged boxes to the ring at `staging`
  // (staging_bytes() of device memory on this GPU, alive as long as this object).
  void upload(void* dev, void* staging, cudaStream_t stream);
  int64_t num_engine_copies() const;
  int64_t num_kernel_boxes() const { return table_.num_boxes(); }
  int64_t num_local_engine_copies() const { return local_engine_.num_copies(); }
  int64_t num_local_kernel_boxes() const { return local_table_.num_boxes(); }
  int64_t num_staged_chunks() const { return static_cast<int64_t>(staging_.chunks.size()); }
  int64_t num_staged_boxes() const;
  // The staged boxes (their indices in the constructor's `boxes`) in the order of the
  // digests a verified execute leaves in begin's stage_digests.
  std::vector<int32_t> staged_boxes() const;
  const std::string& engine_mode() const { return engines_.front().mode(); }

  // Deferred pre-pass work (core/direct.h, prep_schedule; rx.Tuning.direct_prep_overlap): the
  // source regions [addr, addr + bytes) of the tensors whose work the caller may run per tensor
  // on a prep stream; returns the regions the staged chunks read, in the order to run their work
  // (prep event k follows the k-th). The others' work (and every region's, when nothing is staged)
  // must run before the execute as usual. Call once after upload, before the first begin.
  std::vector<int32_t> set_prep(const std::vector<PrepRegion>& regions);
  int32_t num_prep() const { return static_cast<int32_t>(prep_events_.size()); }
  // Per execute with prep, before begin(..., prep = true): prep_start(main, prep) makes `prep`
  // start where `main` is now (the sources ready); the caller then queues the work of the k-th
  // region of set_prep's order on `prep` and calls prep_done(k, prep) after it, for every k.
  void prep_start(cudaStream_t main, cudaStream_t prep);
  void prep_done(int32_t k, cudaStream_t prep);

  // Steps 1 and 2 (see the top of this file) on `main`, the caller's stream, and the
  // same-rank copies. Throws ReshardError when a receiver is not ready within the timeout.
  // landing: write the boxes group by group and signal each group as it lands (a
  // verified execute; otherwise one signal at the end). stage_digests (landing only; 0:
  // none): num_staged_boxes() zeroed uint64 on this GPU into which the execute adds each
  // staged box's send digest (staged_boxes() order), read from the ring as it is copied out;
  // complete when `main` passes end(). prep: this execute's deferred work was queued
  // (prep_start, prep_done): each chunk's pack waits for the work of the tensors it reads,
  // everything else (`main` from here on) for all of it.
  void begin(cudaStream_t main, bool landing = false, uint64_t stage_digests = 0, bool prep = false);
  // Queues on `main` a wait until landing group k of every sender is in this rank (what
  // follows on `main` may read it). A wait that times out leaves the error to end().
  void wait_landed(cudaStream_t main, int32_t k);
  // Step 3; returns once the refit's direct part is complete on `main`'s timeline. With
  // wait=false it only queues step 3 (the caller can queue more behind it first) and
  // finish() must follow before the next begin.
  void end(cudaStream_t main, bool wait = true);
  // The host wait of an end(main, false): returns once the refit is complete; throws
  // ReshardError when a sender never signalled.
  void finish();
  // From any thread (plan.abort(), or a peer that failed or died): the host waits of this
  // execute give up at once and raise, and its GPU waits return (they watch the error
  // word). The transport is then unusable, as after any failure. rearm() takes it back
  // before an execute.
  void abort();
  void rearm() { aborted_.store(false, std::memory_order_release); }

  const std::string& error() const { return error_; }

  // Diagnostics (refit_bench --timeline): while on, each execute records CUDA timing events
  // around its steps (the staged chunks' packs, copies and digests, the copy-engine and
  // kernel writes, the signals and waits); timeline() returns them, in ms from the execute's
  // start on `main`, after waiting for the last.
  void set_trace(bool on) { trace_ = on; }
  std::vector<TraceRow> timeline();

 private:
  [[noreturn]] void fail(const std::string& msg);
  template <class Steps>
  void guarded(Steps&& steps);
  void begin_steps(cudaStream_t main);
  void new_timeline();
  void end_steps(cudaStream_t main);
  void finish_steps();
  void send_landing();
  // Queues a staging script's actions (core/direct.h, stage_script); then makes `stream`
  // wait for every copy stream's group end.
  void run_stage(const std::vector<StageAction>& actions);
  // ... last: the execute's last signal, which waits for a verified execute's digests too.
  void wait_staged(cudaStream_t stream, bool last);
  template <class F>
  void traced(const std::string& kind, int32_t index, cudaStream_t s, F&& fn);
  cudaEvent_t trace_event();
  cudaEvent_t stage_event(int32_t id) const;
  const StageScript& script() const;  // this execute's staging script
  // The kernels' box tables in upload order, each at a 256-byte aligned offset.
  std::vector<const DeviceBoxTable*> tables() const;

  std::shared_ptr<DirectSignals> sig_;
  DirectConfig config_;
  std::vector<EngineQueue> engines_;  // one per stream of ces_
  EngineQueue local_engine_;
  DeviceBoxTable table_, local_table_;
  // A landing execute's writes, group by group: copies per stream of ces_, and kernel boxes.
  struct LandingGroup {
    std::vector<EngineQueue> engines;
    DeviceBoxTable table;
  };
  std::vector<LandingGroup> groups_;
  // Staged boxes: the plan (ring offsets until upload relocates it), its scripts (plain:
  // one part; landing: a part per group), per chunk its pack table and its copies (built at
  // upload: they hold the ring's addresses), the streams (0: pack) and events they use.
  StagingPlan staging_;
  StageScript plain_script_, landing_script_;
  // With deferred pre-pass work (set_prep): the scripts whose packs wait for it, its events
  // (one per region of its order) and the caller's stream when the sources were ready.
  StageScript prep_plain_script_, prep_landing_script_;
  std::vector<cudaEvent_t> prep_events_;
  cudaEvent_t sources_ = nullptr;
  cudaEvent_t prep_mark_ = nullptr;  // tracing: the prep stream's last mark
  bool prep_ = false;  // this execute's packs wait for the deferred work
  std::vector<DeviceBoxTable> stage_tables_, stage_digest_tables_;
  std::vector<int64_t> stage_first_;  // per chunk: the index of its first box in staged_boxes()
  uint64_t* stage_digests_ = nullptr;  // this execute's (begin)
  std::vector<EngineQueue> stage_copies_;
  std::vector<cudaStream_t> stage_streams_;
  std::vector<cudaEvent_t> stage_events_;
  bool landing_ = false;  // this execute lands group by group
  bool unfinished_ = false;  // end(main, false) queued step 3; finish() has not waited for it
  std::vector<int32_t> receivers_, senders_;
  std::vector<uint64_t> done_words_, wait_words_;
  double timeout_s_;
  std::vector<cudaStream_t> ces_;
  std::vector<cudaEvent_t> ce_done_;
  cudaStream_t sm_ = nullptr, local_ce_ = nullptr, signal_ = nullptr;
  cudaEvent_t start_ = nullptr, sent_ = nullptr, local_done_ = nullptr, end_ = nullptr, kernel_done_ = nullptr,
              landed_ = nullptr;
  uint64_t seq_ = 0;
  std::string error_;
  // Tracing (set_trace): timing events, reused across executes, and this execute's marks.
  struct Mark {
    std::string kind;
    int32_t index;
    cudaEvent_t begin, end;
  };
  bool trace_ = false;
  std::vector<cudaEvent_t> trace_pool_;
  size_t trace_used_ = 0;
  std::vector<Mark> marks_;
  cudaStream_t trace_stream_ = nullptr;  // idle: a record there marks when the host got past a wait
  std::atomic<bool> aborted_{false};
};

}  // namespace rx

#endif  // RX_WITH_CUDA
