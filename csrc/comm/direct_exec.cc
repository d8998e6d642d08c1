// The direct transport's signals and per-execute steps: see direct_exec.h.
#include "comm/direct_exec.h"

#ifdef RX_WITH_CUDA

#include <algorithm>
#include <cstring>

#include "common/check.h"
#include "comm/host_wait.h"
#include "comm/peer_map.h"
#include "kernels/signal_api.h"

namespace rx {

namespace {
constexpr uint64_t kAbortedWord = ~uint64_t{0};  // the error word of a stopped execute (abort())
// Once stopped, how long the host waits for the GPU's waits to return (they watch the error word).
constexpr auto kStopGrace = std::chrono::seconds(10);
}  // namespace

namespace {

std::vector<rx_box> kernel_boxes(const std::vector<rx_box>& boxes, int64_t engine_bytes,
                                 std::vector<EngineCopy>* engine) {
  std::vector<rx_box> kernel;
  split_engines(boxes, engine_bytes, engine, &kernel);
  return kernel;
}

void* as_ptr(uint64_t a) { return reinterpret_cast<void*>(static_cast<uintptr_t>(a)); }

// Batched copies need the 12.8 runtime API (built against) and a 12.8 driver (run on).
bool batch_available(std::string* why) {
#if CUDART_VERSION >= 12080
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) {
    cudaGetLastError();
    *why = "the driver version is unknown";
    return false;
  }
  if (driver < 12080) {
    *why = detail::format("the driver supports CUDA ", driver / 1000, ".", driver % 1000 / 10, " (12.8 needed)");
    return false;
  }
  return true;
#else
  *why = "built against a CUDA runtime older than 12.8";
  return false;
#endif
}

}  // namespace

EngineQueue::EngineQueue(const std::vector<EngineCopy>& copies, bool batch) {
  // Merged runs must stay within one allocation on each side: the copy engines refuse a
  // copy across two allocations that happen to touch in the address space.
  EngineBatches b = batch_engines(copies, [](uint64_t a, uint64_t c) {
    const uint64_t start = allocation_start(a);
    return start != 0 && start == allocation_start(c);
  });
  runs_ = std::move(b.runs);
  pitched_ = std::move(b.pitched);
  if (!batch || num_copies() == 0) return;
  std::string why;
  if (!batch_available(&why)) {
    mode_ = "per copy (" + why + ")";
    return;
  }
#if CUDART_VERSION >= 12080
  for (const EngineCopy& c : runs_) {
    dsts_.push_back(as_ptr(c.dst));
    srcs_.push_back(as_ptr(c.src));
    sizes_.push_back(static_cast<size_t>(c.width));
  }
  std::vector<cudaMemcpy3DBatchOp> ops(pitched_.size());
  for (size_t i = 0; i < pitched_.size(); ++i) {
    const EngineCopy& c = pitched_[i];
    cudaMemcpy3DBatchOp op{};
    op.src.type = op.dst.type = cudaMemcpyOperandTypePointer;
    op.src.op.ptr.ptr = as_ptr(c.src);
    op.src.op.ptr.rowLength = static_cast<size_t>(c.spitch);  // elements of one byte
    op.dst.op.ptr.ptr = as_ptr(c.dst);
    op.dst.op.ptr.rowLength = static_cast<size_t>(c.dpitch);
    op.extent.width = static_cast<size_t>(c.width);  // bytes
    op.extent.height = static_cast<size_t>(c.height);
    op.extent.depth = 1;
    op.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // sources are written by earlier work on the stream
    ops[i] = op;
  }
  ops3d_.resize(ops.size() * sizeof(cudaMemcpy3DBatchOp));
  if (!ops.empty()) std::memcpy(ops3d_.data(), ops.data(), ops3d_.size());
  batch_ = true;
  mode_ = "batched";
#endif
}

void EngineQueue::issue_each(cudaStream_t stream) {
  for (const EngineCopy& c : runs_)
    RX_CUDA_CHECK(cudaMemcpyAsync(as_ptr(c.dst), as_ptr(c.src), static_cast<size_t>(c.width), cudaMemcpyDefault,
                                  stream));
  for (const EngineCopy& c : pitched_)
    RX_CUDA_CHECK(cudaMemcpy2DAsync(as_ptr(c.dst), static_cast<size_t>(c.dpitch), as_ptr(c.src),
                                    static_cast<size_t>(c.spitch), static_cast<size_t>(c.width),
                                    static_cast<size_t>(c.height), cudaMemcpyDefault, stream));
}

cudaError_t EngineQueue::issue_batched(cudaStream_t stream) {
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t first = 0;
  auto* ops = reinterpret_cast<cudaMemcpy3DBatchOp*>(ops3d_.data());
  cudaError_t e = cudaSuccess;
#if CUDART_VERSION >= 13000
  if (!runs_.empty()) e = cudaMemcpyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(), runs_.size(), &attr, &first,
                                               1, stream);
  if (e == cudaSuccess && !pitched_.empty()) e = cudaMemcpy3DBatchAsync(pitched_.size(), ops, 0, stream);
#else
  size_t fail = 0;
  if (!runs_.empty())
    e = cudaMemcpyBatchAsync(dsts_.data(), const_cast<void**>(srcs_.data()), sizes_.data(), runs_.size(), &attr,
                             &first, 1, &fail, stream);
  if (e == cudaSuccess && !pitched_.empty()) e = cudaMemcpy3DBatchAsync(pitched_.size(), ops, &fail, 0, stream);
#endif
  return e;
#else
  (void)stream;
  return cudaErrorNotSupported;
#endif
}

void EngineQueue::issue(cudaStream_t stream) {
  if (batch_) {
    const cudaError_t e = issue_batched(stream);
    if (e == cudaSuccess) return;
    // A refused batch enqueues nothing; copying a box twice (if part of it ran) writes the
    // same bytes. An error left by earlier work raises in the calls below.
    cudaGetLastError();
    batch_ = false;
    mode_ = detail::format("per copy (the batched call failed: ", cudaGetErrorString(e), ")");
  }
  issue_each(stream);
}

DirectSignals::DirectSignals(int rank, int world, int device, double timeout_s)
    : rank_(rank), world_(world), device_(device) {
  RX_USER_CHECK(world >= 1 && rank >= 0 && rank < world, "direct transport: rank ", rank, " not in a group of ",
                world);
  DeviceGuard guard(device_);
  // Allocated here, not by torch: peers map it through CUDA IPC, which torch's allocator
  // may not allow (expandable segments), and it is a few bytes for the plan's lifetime.
  const size_t bytes = static_cast<size_t>(world) * sizeof(uint64_t);
  RX_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&flags_), bytes));
  try {
    zero_bounded(flags_, bytes, timeout_s, "direct transport");  // the zeroes land before any peer can look
    std::string why;
    RX_USER_CHECK(ipc_export(reinterpret_cast<uintptr_t>(flags_), &flags_export_, &why),
                  "direct transport: cannot share its signal words: ", why);
    page_ = SharedPage::create();
  } catch (...) {
    cudaFree(flags_);  // the destructor does not run for a half-built object
    throw;
  }
}

DirectSignals::~DirectSignals() {
  peers_.clear();
  page_.reset();
  if (flags_ != nullptr) {
    cudaFree(flags_);
    cudaGetLastError();
  }
}

std::string DirectSignals::attach(int peer, const IpcExport& flags, const std::string& page_path) {
  if (peer < 0 || peer >= world_ || peer == rank_) return detail::format("rank ", peer, " is not a peer");
  if (attached(peer)) return "";
  if (flags.offset + static_cast<uint64_t>(world_) * sizeof(uint64_t) > flags.size)
    return detail::format("rank ", peer, "'s signal words are smaller than the group");
  DeviceGuard guard(device_);
  Peer p;
  p.flags = std::make_unique<IpcMapping>(flags.handle);
  if (!p.flags->ok()) return detail::format("mapping rank ", peer, "'s signal words: ", p.flags->why());
  p.flags_offset = flags.offset;
  std::string why;
  p.page = SharedPage::open(page_path, &why);
  if (!p.page) return detail::format("mapping rank ", peer, "'s shared page: ", why);
  peers_.emplace(peer, std::move(p));
  return "";
}

uint64_t DirectSignals::peer_flag(int peer) const {
  const Peer& p = peers_.at(peer);
  return p.flags->base() + p.flags_offset + static_cast<uint64_t>(rank_) * sizeof(uint64_t);
}

uint64_t DirectSignals::own_flag(int peer) const {
  RX_HOST_ASSERT(peer >= 0 && peer < world_, "own_flag: bad peer ", peer);
  return reinterpret_cast<uintptr_t>(flags_ + peer);
}

uint64_t DirectSignals::peer_ready(int peer) const {
  return __atomic_load_n(const_cast<const uint64_t*>(peers_.at(peer).page->words()), __ATOMIC_ACQUIRE);
}

DirectExec::DirectExec(std::shared_ptr<DirectSignals> signals, const std::vector<rx_box>& all_boxes,
                       const std::vector<rx_box>& local, const DirectConfig& config, std::vector<int32_t> receivers,
                       std::vector<int32_t> senders, double timeout_s, const std::vector<int32_t>& all_groups,
                       const std::vector<uint8_t>& box_stageable,
                       const std::vector<int64_t>& box_ordinals)
    : sig_(std::move(signals)),
      config_(config),
      receivers_(std::move(receivers)),
      senders_(std::move(senders)),
      timeout_s_(timeout_s) {
  RX_HOST_ASSERT(sig_ != nullptr, "DirectExec: no signals");
  RX_HOST_ASSERT(config_.landing_groups >= 1 && config_.landing_groups <= kMaxLandingGroups,
                 "DirectExec: ", config_.landing_groups, " landing groups");
  RX_HOST_ASSERT(all_groups.empty() || all_groups.size() == all_boxes.size(), "DirectExec: ", all_groups.size(),
                 " landing groups for ", all_boxes.size(), " boxes");
  for (int32_t k : all_groups) RX_HOST_ASSERT(k >= 0 && k < config_.landing_groups, "DirectExec: landing group ", k);
  // The sender's codec boxes that can go through the staging ring, and the rest.
  std::vector<int32_t> rest;
  staging_ = plan_staging(all_boxes, all_groups,
                          box_stageable.empty() ? std::vector<uint8_t>(all_boxes.size(), 0) : box_stageable,
                          config_.stage_slot_bytes, &rest, box_ordinals, config_.stage_slots);
  int64_t first = 0;
  for (const StagedChunk& c : staging_.chunks) {  // tables for their sizes: rebuilt at upload
    stage_first_.push_back(first);
    first += static_cast<int64_t>(c.pack.size());
    stage_tables_.emplace_back(c.pack);
    stage_digest_tables_.emplace_back(c.digest);
  }
  plain_script_ = stage_script(staging_, 0, config_.stage_streams);
  landing_script_ = stage_script(staging_, config_.landing_groups, config_.stage_streams, /*digest=*/true);
  std::vector<rx_box> boxes;
  std::vector<int32_t> box_groups;
  for (int32_t i : rest) {
    boxes.push_back(all_boxes[static_cast<size_t>(i)]);
    if (!all_groups.empty()) box_groups.push_back(all_groups[static_cast<size_t>(i)]);
  }
  std::vector<EngineCopy> engine, local_engine;
  table_ = DeviceBoxTable(kernel_boxes(boxes, config_.engine_bytes, &engine));
  local_table_ = DeviceBoxTable(kernel_boxes(local, config_.local_engine_bytes, &local_engine));
  for (const std::vector<EngineCopy>& part : spread_engines(engine, config_.engine_streams))
    engines_.emplace_back(part, config_.batch);
  local_engine_ = EngineQueue(local_engine, config_.batch);
  if (!all_boxes.empty()) {
    // Each group spreads over the streams its own copies call for (auto_engine_streams),
    // at most the whole's: a small late group spread over every stream would be cut into
    // many small copies, and the link would wait for each one's setup.
    std::vector<std::vector<rx_box>> by_group(static_cast<size_t>(config_.landing_groups));
    for (size_t i = 0; i < boxes.size(); ++i) {
      const int32_t k = box_groups.empty() ? 0 : box_groups[i];
      by_group[static_cast<size_t>(k)].push_back(boxes[i]);
    }
    for (const std::vector<rx_box>& part : by_group) {
      std::vector<EngineCopy> copies;
      LandingGroup g;
      g.table = DeviceBoxTable(kernel_boxes(part, config_.engine_bytes, &copies));
      const int streams = std::min(static_cast<int>(engines_.size()), auto_engine_streams(copies.size()));
      for (const std::vector<EngineCopy>& q : spread_engines(copies, streams))
        g.engines.emplace_back(q, config_.batch);
      groups_.push_back(std::move(g));
    }
  }
  for (int32_t r : receivers_) {
    RX_HOST_ASSERT(sig_->attached(r), "DirectExec: receiver ", r, " not attached");
    done_words_.push_back(sig_->peer_flag(r));
  }
  for (int32_t s : senders_) wait_words_.push_back(sig_->own_flag(s));
  RX_HOST_ASSERT(all_boxes.empty() || !receivers_.empty(), "DirectExec: boxes without a receiver");
  DeviceGuard guard(sig_->device());
  int lowest = 0, highest = 0;
  RX_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
  // High priority, like the NCCL side stream: the link is the refit's critical path.
  ces_.resize(engines_.size(), nullptr);
  ce_done_.resize(engines_.size(), nullptr);
  for (size_t k = 0; k < ces_.size(); ++k) {
    RX_CUDA_CHECK(cudaStreamCreateWithPriority(&ces_[k], cudaStreamNonBlocking, highest));
    RX_CUDA_CHECK(cudaEventCreateWithFlags(&ce_done_[k], cudaEventDisableTiming));
  }
  RX_CUDA_CHECK(cudaStreamCreateWithPriority(&sm_, cudaStreamNonBlocking, highest));
  RX_CUDA_CHECK(cudaStreamCreateWithPriority(&signal_, cudaStreamNonBlocking, highest));
  RX_CUDA_CHECK(cudaStreamCreateWithFlags(&local_ce_, cudaStreamNonBlocking));
  for (cudaEvent_t* e : {&start_, &sent_, &local_done_, &end_, &kernel_done_, &landed_})
    RX_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  if (!staging_.chunks.empty()) {
    stage_streams_.resize(static_cast<size_t>(1 + plain_script_.streams), nullptr);
    for (cudaStream_t& st : stage_streams_) RX_CUDA_CHECK(cudaStreamCreateWithPriority(&st, cudaStreamNonBlocking, highest));
    stage_events_.resize(static_cast<size_t>(std::max(plain_script_.events, landing_script_.events)), nullptr);
    for (cudaEvent_t& e : stage_events_) RX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
}

int64_t DirectExec::num_staged_boxes() const {
  int64_t n = 0;
  for (const StagedChunk& c : staging_.chunks) n += static_cast<int64_t>(c.pack.size());
  return n;
}

std::vector<const DeviceBoxTable*> DirectExec::tables() const {
  std::vector<const DeviceBoxTable*> out{&table_, &local_table_};
  for (const LandingGroup& g : groups_) out.push_back(&g.table);
  for (const DeviceBoxTable& t : stage_tables_) out.push_back(&t);
  for (const DeviceBoxTable& t : stage_digest_tables_) out.push_back(&t);
  return out;
}

std::vector<int32_t> DirectExec::staged_boxes() const {
  std::vector<int32_t> out;
  for (const StagedChunk& c : staging_.chunks) out.insert(out.end(), c.boxes.begin(), c.boxes.end());
  return out;
}

int64_t DirectExec::table_bytes() const {
  int64_t n = 0;
  for (const DeviceBoxTable* t : tables()) n += (t->bytes_needed() + 255) / 256 * 256;
  return n;
}

int64_t DirectExec::num_engine_copies() const {
  int64_t n = 0;
  for (const EngineQueue& q : engines_) n += q.num_copies();
  return n;
}

void DirectExec::upload(void* dev, void* staging, cudaStream_t stream) {
  RX_HOST_ASSERT(staging != nullptr || staging_.chunks.empty(), "DirectExec::upload: no staging ring");
  RX_HOST_ASSERT(stage_copies_.empty(), "DirectExec::upload: called twice");
  const int64_t planned = table_bytes();  // what the caller allocated, from the tables at ring offsets
  relocate_staging(&staging_, reinterpret_cast<uintptr_t>(staging));
  stage_tables_.clear();
  stage_digest_tables_.clear();
  for (const StagedChunk& c : staging_.chunks) {
    stage_tables_.emplace_back(c.pack);
    stage_digest_tables_.emplace_back(c.digest);
    stage_copies_.emplace_back(c.copies, config_.batch);
  }
  RX_HOST_ASSERT(table_bytes() == planned, "DirectExec::upload: the staged tables changed size at the ring's base");
  int64_t at = 0;
  for (const DeviceBoxTable* t : tables()) {
    const_cast<DeviceBoxTable*>(t)->upload(static_cast<char*>(dev) + at, stream);
    at += (t->bytes_needed() + 255) / 256 * 256;
  }
}

DirectExec::~DirectExec() {
  // Work still queued keeps the streams and events alive: CUDA defers their release.
  for (cudaEvent_t e : {start_, sent_, local_done_, end_, kernel_done_, landed_})
    if (e != nullptr) cudaEventDestroy(e);
  for (cudaEvent_t e : ce_done_)
    if (e != nullptr) cudaEventDestroy(e);
  for (cudaStream_t s : {sm_, local_ce_, signal_})
    if (s != nullptr) cudaStreamDestroy(s);
  for (cudaEvent_t e : stage_events_)
    if (e != nullptr) cudaEventDestroy(e);
  for (cudaEvent_t e : prep_events_)
    if (e != nullptr) cudaEventDestroy(e);
  if (sources_ != nullptr) cudaEventDestroy(sources_);
  for (cudaStream_t s : ces_)
    if (s != nullptr) cudaStreamDestroy(s);
  for (cudaStream_t s : stage_streams_)
    if (s != nullptr) cudaStreamDestroy(s);
  for (cudaEvent_t e : trace_pool_) cudaEventDestroy(e);
  if (trace_stream_ != nullptr) cudaStreamDestroy(trace_stream_);
  cudaGetLastError();
}

void DirectExec::abort() {
  aborted_.store(true, std::memory_order_release);
  // the GPU waits of this execute return on a non-zero error word (kernels/signal.cu)
  __atomic_store_n(sig_->error_host(), kAbortedWord, __ATOMIC_RELEASE);
}

void DirectExec::fail(const std::string& msg) {
  if (error_.empty()) error_ = msg;
  throw ReshardError(msg + ". The plan's direct transport is unusable now (plan again on every rank).");
}

template <class Steps>
void DirectExec::guarded(Steps&& steps) {
  RX_USER_CHECK(error_.empty(), "direct transport unusable after an earlier failure: ", error_);
  try {
    steps();
  } catch (const std::exception& e) {
    if (error_.empty()) error_ = e.what();  // the ranks' sequences may differ from here on
    throw;
  }
}

std::vector<int32_t> DirectExec::set_prep(const std::vector<PrepRegion>& regions) {
  RX_HOST_ASSERT(prep_events_.empty(), "DirectExec::set_prep: called twice");
  const PrepSchedule s = prep_schedule(staging_, regions);
  if (s.order.empty()) return {};
  prep_plain_script_ = stage_script(staging_, 0, config_.stage_streams, false, s.gates);
  prep_landing_script_ = stage_script(staging_, config_.landing_groups, config_.stage_streams, true, s.gates);
  DeviceGuard guard(sig_->device());
  if (sources_ == nullptr) RX_CUDA_CHECK(cudaEventCreateWithFlags(&sources_, cudaEventDisableTiming));
  prep_events_.resize(s.order.size(), nullptr);
  for (cudaEvent_t& e : prep_events_) RX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return s.order;
}

void DirectExec::new_timeline() {
  marks_.clear();
  trace_used_ = 0;
}

void DirectExec::prep_start(cudaStream_t main, cudaStream_t prep) {
  RX_USER_CHECK(error_.empty(), "direct transport unusable after an earlier failure: ", error_);
  RX_HOST_ASSERT(!prep_events_.empty(), "DirectExec::prep_start without deferred work (set_prep)");
  if (unfinished_) finish();  // the previous execute's timeline and events are done with
  DeviceGuard guard(sig_->device());
  new_timeline();
  traced("start", 0, main, [] {});  // the timeline's origin: the prep work runs before begin()
  RX_CUDA_CHECK(cudaEventRecord(sources_, main));
  RX_CUDA_CHECK(cudaStreamWaitEvent(prep, sources_, 0));
  if (trace_) {
    prep_mark_ = trace_event();
    RX_CUDA_CHECK(cudaEventRecord(prep_mark_, prep));
  }
}

void DirectExec::prep_done(int32_t k, cudaStream_t prep) {
  RX_HOST_ASSERT(k >= 0 && k < num_prep(), "DirectExec::prep_done: region ", k, " of ", num_prep());
  DeviceGuard guard(sig_->device());
  RX_CUDA_CHECK(cudaEventRecord(prep_events_[static_cast<size_t>(k)], prep));
  if (trace_ && prep_mark_ != nullptr) {
    cudaEvent_t end = trace_event();
    RX_CUDA_CHECK(cudaEventRecord(end, prep));
    marks_.push_back(Mark{"prep", k, prep_mark_, end});
    prep_mark_ = end;
  }
}

void DirectExec::begin(cudaStream_t main, bool landing, uint64_t stage_digests, bool prep) {
  if (unfinished_) finish();  // an execute whose caller never waited for its end
  RX_HOST_ASSERT(!prep || !prep_events_.empty(), "DirectExec::begin: prep without deferred work (set_prep)");
  prep_ = prep;
  landing_ = landing && !groups_.empty();
  stage_digests_ = landing_ ? reinterpret_cast<uint64_t*>(static_cast<uintptr_t>(stage_digests)) : nullptr;
  guarded([&] { begin_steps(main); });
}

void DirectExec::wait_landed(cudaStream_t main, int32_t k) {
  RX_USER_CHECK(error_.empty(), "direct transport unusable after an earlier failure: ", error_);
  RX_HOST_ASSERT(k >= 0 && k < config_.landing_groups, "wait_landed: group ", k);
  if (senders_.empty()) return;
  DeviceGuard guard(sig_->device());
  const double ns = std::min(timeout_s_, 1e7) * 1e9;
  traced("wait landed group", k, main, [&] {
    RX_CUDA_CHECK(rx_signal_wait_cuda(wait_words_.data(), static_cast<int32_t>(wait_words_.size()),
                                      landed_word(seq_, k + 1, config_.landing_groups), static_cast<uint64_t>(ns),
                                      sig_->error_device(), 0, main));
  });
}

void DirectExec::end(cudaStream_t main, bool wait) {
  guarded([&] { end_steps(main); });
  unfinished_ = true;
  if (wait) finish();
}

void DirectExec::finish() {
  RX_HOST_ASSERT(unfinished_, "DirectExec::finish without an end(main, false) before it");
  unfinished_ = false;
  guarded([&] { finish_steps(); });
}

void DirectExec::begin_steps(cudaStream_t main) {
  DeviceGuard guard(sig_->device());
  seq_ = sig_->next_seq();
  *sig_->error_host() = 0;  // the previous execute has ended (end() waited): no kernel writes it now
  if (!prep_) {  // else prep_start began this execute's timeline
    new_timeline();
    traced("start", 0, main, [] {});  // the timeline's origin
  }
  if (!senders_.empty()) {
    const uint64_t ready = sig_->ready_device();
    RX_CUDA_CHECK(rx_signal_store_cuda(&ready, 1, seq_, main));
  }
  // Everything but the staged packs (which wait for their own tensors' work) starts after
  // all deferred work: non-staged boxes read the same factors and scales.
  if (prep_) traced("wait prep", 0, main, [&] { RX_CUDA_CHECK(cudaStreamWaitEvent(main, prep_events_.back(), 0)); });
  // From here on the sources are ready and this rank's destinations free: the same-rank
  // copies start now, before the host waits for the receivers below.
  RX_CUDA_CHECK(cudaEventRecord(start_, main));
  if (local_engine_.num_copies() > 0) {
    RX_CUDA_CHECK(cudaStreamWaitEvent(local_ce_, start_, 0));
    traced("local engine", 0, local_ce_, [&] { local_engine_.issue(local_ce_); });
    RX_CUDA_CHECK(cudaEventRecord(local_done_, local_ce_));
  }
  if (local_table_.num_boxes() > 0)
    traced("local kernel", 0, main, [&] { local_table_.launch(main, config_.local_blocks); });
  if (receivers_.empty()) return;
  run_stage(script().prefill);  // local writes only: before the receivers are ready
  const auto deadline = deadline_after(timeout_s_);
  Backoff backoff(50);
  for (int32_t r : receivers_) {
    while (sig_->peer_ready(r) < seq_) {
      if (aborted_.load(std::memory_order_acquire))
        fail(detail::format("rank ", sig_->rank(), ": execute #", seq_, " was stopped before the direct writes"));
      if (Clock::now() > deadline)
        fail(detail::format("rank ", sig_->rank(), ": rank ", r, " did not start execute #", seq_,
                            " of this plan within ", timeout_s_,
                            " s (its destinations never became free for the direct writes): it died, skipped "
                            "rx.execute, or runs another plan"));
      backoff.pause();
    }
  }
  if (trace_) {  // an idle stream's record completes as it is queued: when the host got here
    if (trace_stream_ == nullptr) RX_CUDA_CHECK(cudaStreamCreateWithFlags(&trace_stream_, cudaStreamNonBlocking));
    traced("host: receivers ready", 0, trace_stream_, [] {});
  }
  RX_CUDA_CHECK(cudaStreamWaitEvent(sm_, start_, 0));
  for (size_t k = 0; k < ces_.size(); ++k) RX_CUDA_CHECK(cudaStreamWaitEvent(ces_[k], start_, 0));
  if (landing_) return send_landing();
  for (size_t k = 0; k < ces_.size(); ++k)
    traced("engine", static_cast<int32_t>(k), ces_[k], [&] { engines_[k].issue(ces_[k]); });
  if (table_.num_boxes() > 0) traced("kernel", 0, sm_, [&] { table_.launch(sm_, 0); });
  run_stage(script().parts.front());
  wait_staged(sm_, true);
  for (size_t k = 0; k < ces_.size(); ++k) {
    RX_CUDA_CHECK(cudaEventRecord(ce_done_[k], ces_[k]));
    RX_CUDA_CHECK(cudaStreamWaitEvent(sm_, ce_done_[k], 0));
  }
  const uint64_t done = landed_word(seq_, 1, 1);
  traced("signal", 0, sm_, [&] {
    RX_CUDA_CHECK(rx_signal_store_cuda(done_words_.data(), static_cast<int32_t>(done_words_.size()), done, sm_));
  });
  RX_CUDA_CHECK(cudaEventRecord(sent_, sm_));
}

void DirectExec::send_landing() {
  // signal_ waits for each group's end on every stream it uses, then signals it; each copy
  // stream starts a group only once the one before has landed everywhere, since the
  // engines may serve some streams before others (a stream's later groups would then go
  // before another stream's first). Events are re-recorded per group: a wait takes the
  // record current when it is queued.
  const auto groups = static_cast<int32_t>(groups_.size());
  for (int32_t k = 0; k < groups; ++k) {
    LandingGroup& g = groups_[static_cast<size_t>(k)];
    for (size_t j = 0; j < g.engines.size(); ++j) {  // the first streams (spread_engines per group)
      if (k > 0) RX_CUDA_CHECK(cudaStreamWaitEvent(ces_[j], landed_, 0));
      traced("engine " + std::to_string(j) + " group", k, ces_[j], [&] { g.engines[j].issue(ces_[j]); });
      RX_CUDA_CHECK(cudaEventRecord(ce_done_[j], ces_[j]));
      RX_CUDA_CHECK(cudaStreamWaitEvent(signal_, ce_done_[j], 0));
    }
    traced("kernel group", k, sm_, [&] { g.table.launch(sm_, 0); });
    RX_CUDA_CHECK(cudaEventRecord(kernel_done_, sm_));
    RX_CUDA_CHECK(cudaStreamWaitEvent(signal_, kernel_done_, 0));
    run_stage(script().parts[static_cast<size_t>(k)]);
    wait_staged(signal_, k + 1 == groups);
    traced("signal group", k, signal_, [&] {
      RX_CUDA_CHECK(rx_signal_store_cuda(done_words_.data(), static_cast<int32_t>(done_words_.size()),
                                         landed_word(seq_, k + 1, groups), signal_));
    });
    RX_CUDA_CHECK(cudaEventRecord(landed_, signal_));
  }
  RX_CUDA_CHECK(cudaEventRecord(sent_, signal_));
}

const StageScript& DirectExec::script() const {
  if (prep_) return landing_ ? prep_landing_script_ : prep_plain_script_;
  return landing_ ? landing_script_ : plain_script_;
}

cudaEvent_t DirectExec::stage_event(int32_t id) const {
  if (id == kStageStart) return start_;
  if (id == kStageLanded) return landed_;
  if (id == kStageSources) return sources_;
  if (stage_prep_index(id) >= 0) {
    RX_HOST_ASSERT(stage_prep_index(id) < num_prep(), "staging script: prep event ", stage_prep_index(id));
    return prep_events_[static_cast<size_t>(stage_prep_index(id))];
  }
  RX_HOST_ASSERT(id >= 0 && id < static_cast<int32_t>(stage_events_.size()), "staging script: event ", id);
  return stage_events_[static_cast<size_t>(id)];
}

void DirectExec::run_stage(const std::vector<StageAction>& actions) {
  for (const StageAction& a : actions) {
    RX_HOST_ASSERT(a.stream >= 0 && a.stream < static_cast<int32_t>(stage_streams_.size()),
                   "staging script: stream ", a.stream);
    cudaStream_t s = stage_streams_[static_cast<size_t>(a.stream)];
    const auto c = static_cast<size_t>(a.arg);
    switch (a.op) {
      case kStagePack: traced("pack", a.arg, s, [&] { stage_tables_[c].launch(s, 0); }); break;
      case kStageCopy: traced("copy", a.arg, s, [&] { stage_copies_[c].issue(s); }); break;
      case kStageDigest:
        if (stage_digests_ != nullptr)
          traced("digest", a.arg, s, [&] {
            stage_digest_tables_[c].launch_digest(s, 0, stage_digests_ + stage_first_[c], RX_PASS_SRC);
          });
        break;
      case kStageWait: RX_CUDA_CHECK(cudaStreamWaitEvent(s, stage_event(a.arg), 0)); break;
      case kStageRecord:
        RX_HOST_ASSERT(a.arg >= 0, "staging script: records the executor's event ", a.arg);
        RX_CUDA_CHECK(cudaEventRecord(stage_event(a.arg), s));
        break;
      default: RX_HOST_ASSERT(false, "staging script: action ", a.op);
    }
  }
}

void DirectExec::wait_staged(cudaStream_t stream, bool last) {
  if (staging_.chunks.empty()) return;
  const StageScript& sc = script();
  for (int32_t e = 0; e < sc.streams; ++e)
    RX_CUDA_CHECK(cudaStreamWaitEvent(stream, stage_event(2 * staging_.slots + e), 0));
  if (last && sc.events > 2 * staging_.slots + sc.streams)  // the digests' end (stage_script)
    RX_CUDA_CHECK(cudaStreamWaitEvent(stream, stage_event(2 * staging_.slots + sc.streams), 0));
}

cudaEvent_t DirectExec::trace_event() {
  if (trace_used_ == trace_pool_.size()) {
    cudaEvent_t e = nullptr;
    RX_CUDA_CHECK(cudaEventCreate(&e));
    trace_pool_.push_back(e);
  }
  return trace_pool_[trace_used_++];
}

template <class F>
void DirectExec::traced(const std::string& kind, int32_t index, cudaStream_t s, F&& fn) {
  if (!trace_) {
    fn();
    return;
  }
  cudaEvent_t begin = trace_event();
  RX_CUDA_CHECK(cudaEventRecord(begin, s));
  fn();
  cudaEvent_t end = trace_event();
  RX_CUDA_CHECK(cudaEventRecord(end, s));
  marks_.push_back(Mark{kind, index, begin, end});
}

std::vector<TraceRow> DirectExec::timeline() {
  std::vector<TraceRow> rows;
  if (marks_.empty()) return rows;
  DeviceGuard guard(sig_->device());
  for (const Mark& m : marks_) RX_CUDA_CHECK(cudaEventSynchronize(m.end));
  const cudaEvent_t t0 = marks_.front().begin;
  auto ms = [&](cudaEvent_t e) {
    float v = 0;
    RX_CUDA_CHECK(cudaEventElapsedTime(&v, t0, e));
    return static_cast<double>(v);
  };
  for (const Mark& m : marks_) rows.push_back(TraceRow{m.kind, m.index, ms(m.begin), ms(m.end)});
  return rows;
}

void DirectExec::end_steps(cudaStream_t main) {
  DeviceGuard guard(sig_->device());
  // The caller's later work may overwrite the sources: it waits for the sends.
  if (!receivers_.empty()) RX_CUDA_CHECK(cudaStreamWaitEvent(main, sent_, 0));
  if (local_engine_.num_copies() > 0) RX_CUDA_CHECK(cudaStreamWaitEvent(main, local_done_, 0));
  if (!senders_.empty()) {
    const double ns = std::min(timeout_s_, 1e7) * 1e9;
    traced("wait senders", 0, main, [&] {
      RX_CUDA_CHECK(rx_signal_wait_cuda(wait_words_.data(), static_cast<int32_t>(wait_words_.size()),
                                        landed_word(seq_, 1, 1), static_cast<uint64_t>(ns), sig_->error_device(), 0,
                                        main));
    });
  }
  traced("end", 0, main, [] {});
  RX_CUDA_CHECK(cudaEventRecord(end_, main));
}

void DirectExec::finish_steps() {
  // The device waits are bounded by timeout_s; this bound only catches a stream that
  // never reaches them (work queued before the refit that does not finish).
  const double host_timeout = 2 * timeout_s_ + 30;
  const auto deadline = deadline_after(host_timeout);
  Clock::time_point stopped{};
  Backoff backoff(50);
  while (true) {
    const cudaError_t q = cudaEventQuery(end_);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) RX_CUDA_CHECK(q);
    // stopped: the GPU waits return on the error word; work queued before the refit may not
    if (aborted_.load(std::memory_order_acquire)) {
      if (stopped == Clock::time_point{}) stopped = Clock::now();
      if (Clock::now() - stopped > kStopGrace)
        fail(detail::format("rank ", sig_->rank(), ": execute #", seq_, " was stopped and its GPU work did not end"));
    }
    if (Clock::now() > deadline)
      fail(detail::format("rank ", sig_->rank(), ": execute #", seq_, " of this plan did not finish on the GPU within ",
                          host_timeout, " s"));
    backoff.pause();
  }
  const uint64_t late = __atomic_load_n(const_cast<const uint64_t*>(sig_->error_host()), __ATOMIC_ACQUIRE);
  if (late == kAbortedWord)
    fail(detail::format("rank ", sig_->rank(), ": execute #", seq_, " was stopped while it waited for its senders; "
                        "destinations written by ranks ", ranks_text(senders_), " may be partly updated"));
  if (late != 0) {
    const int32_t peer = late <= senders_.size() ? senders_[late - 1] : -1;
    fail(detail::format("rank ", sig_->rank(), ": rank ", peer, " did not signal within ", timeout_s_,
                        " s that its direct writes of execute #", seq_,
                        " landed (it died, skipped rx.execute, or runs another plan); destinations written by ranks ",
                        ranks_text(senders_), " may be partly updated"));
  }
}

}  // namespace rx

#endif  // RX_WITH_CUDA
