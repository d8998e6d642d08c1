#include "comm/executor.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <ctime>
#include <sstream>

#include "common/check.h"
#include "kernels/api.h"
#include "kernels/digest.h"

#ifdef RX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "comm/host_wait.h"
#include "comm/nccl_comm.h"
#include "comm/nvshmem_comm.h"
#include "kernels/device_table.h"
#endif

namespace rx {

namespace {

std::vector<rx_box> pick(const std::vector<rx_box>& boxes, const std::vector<int32_t>& which) {
  std::vector<rx_box> out;
  out.reserve(which.size());
  for (int32_t i : which) out.push_back(boxes[static_cast<size_t>(i)]);
  return out;
}

bool same(const std::vector<Message>& a, const std::vector<Message>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](const Message& x, const Message& y) {
           return x.peer == y.peer && x.ptr == y.ptr && x.bytes == y.bytes;
         });
}

std::string with_batch(const char* kind, int32_t n) { return std::string(kind) + " " + std::to_string(n); }

// (thread CPU, wall) seconds now
std::pair<double, double> host_now() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  return {static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec), wall};
}

}  // namespace

Executor::Executor(std::unique_ptr<Device> device) : device_(std::move(device)) {}

void Executor::prepare(std::shared_ptr<const ExecTables> tables, bool sliced, int32_t max_blocks,
                       const std::vector<std::pair<uint64_t, int64_t>>& recv_staging) {
  const ExecTables& t = *tables;
  const int32_t nb = t.num_batches();
  device_->clear_tables();
  copy_.clear();
  pack_.clear();
  unpack_.clear();
  if (sliced) {
    int32_t i = 0;
    for (const auto& part : t.copies_split(nb)) copy_.push_back(device_->add_table(part, with_batch("copy", i++)));
  } else {
    copy_.push_back(device_->add_table(t.copies(), "copy 0"));
  }
  messages_.clear();
  std::vector<int32_t> peers;
  for (int32_t b = 0; b < nb; ++b) {
    pack_.push_back(device_->add_table(t.pack(b), with_batch("pack", b)));
    unpack_.push_back(device_->add_table(t.unpack(b), with_batch("unpack", b)));
    messages_.emplace_back(t.send_messages(b), t.recv_messages(b));
    for (const Message& m : t.send_messages(b)) peers.push_back(m.peer);
    for (const Message& m : t.recv_messages(b)) peers.push_back(m.peer);
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  peers_ = std::move(peers);
  max_blocks_ = max_blocks;
  recv_staging_ = recv_staging;
  parts_.clear();
  round_tables_.clear();
  round_messages_.clear();
  digest_slots_ = 0;
  verify_built_ = false;
  tables_ = std::move(tables);
}

int64_t Executor::build_verify() {
  if (verify_built()) return digest_slots_;
  RX_HOST_ASSERT(tables_, "build_verify before prepare");
  const ExecTables& t = *tables_;
  const int32_t nb = t.num_batches();
  // Per batch the pack, the direct sends (no pack box: their sources are read), the
  // unpack and the direct receives (their destinations are read once they landed).
  auto add = [&](int32_t table, bool send, std::vector<int32_t> ops) {
    parts_.push_back(Part{table, digest_slots_, send, std::move(ops)});
    digest_slots_ += device_->num_boxes(table);
  };
  const bool cut = transport_ && transport_->rounds();
  const int32_t rounds = verify_rounds(nb);
  for (int32_t b = 0; b < nb; ++b) {
    add(pack_[b], true, t.pack_ops(b));
    add(device_->add_table(pick(t.send_boxes(), t.direct_sends(b)), with_batch("direct sends", b)), true,
        t.direct_sends(b));
    add(unpack_[b], false, t.unpack_ops(b));
    add(device_->add_table(pick(t.recv_boxes(), t.direct_recvs(b)), with_batch("direct recvs", b)), false,
        t.direct_recvs(b));
    // With rounds, the last batch's direct receives' pieces per round, adding into part
    // 4b+3's slots. An earlier batch's are read whole under the next batch's transfer.
    std::vector<int32_t> per_round;
    if (cut && b + 1 == nb && !t.direct_recvs(b).empty())
      for (int32_t r = 0; r < rounds; ++r)
        per_round.push_back(device_->add_table(t.direct_recv_round(b, r, rounds),
                                               "direct recvs " + std::to_string(b) + " r" + std::to_string(r)));
    round_tables_.push_back(std::move(per_round));
  }
  // The last batch, whether this rank receives directly or not: both ends of a pair must
  // cut alike (a batch without large ops stays one exchange, in round 0). Every other batch
  // is one exchange (no rounds: an empty entry).
  if (cut)
    for (int32_t b = 0; b < nb; ++b) {
      round_messages_.emplace_back();
      if (b + 1 < nb) continue;
      for (int32_t r = 0; r < rounds; ++r)
        round_messages_.back().emplace_back(t.round_messages(b, true, r, rounds),
                                            t.round_messages(b, false, r, rounds));
    }
  verify_built_ = true;
  return digest_slots_;
}

std::pair<std::vector<uint64_t>, std::vector<uint64_t>> Executor::collect(const uint64_t* host, int64_t n) const {
  RX_HOST_ASSERT(n >= digest_slots_, "collect: ", n, " digests for ", digest_slots_, " slots");
  const RankPlan& p = tables_->plan();
  std::vector<uint64_t> send(p.sends.size(), 0), recv(p.recvs.size(), 0);
  for (const Part& part : parts_) {
    std::vector<uint64_t>& out = part.send ? send : recv;
    for (size_t i = 0; i < part.ops.size(); ++i) out[static_cast<size_t>(part.ops[i])] = host[part.slot + i];
  }
  return {send, recv};
}

std::vector<int64_t> Executor::digest_signs() const {
  std::vector<int64_t> signs(static_cast<size_t>(digest_slots_), 0);
  for (const Part& part : parts_)
    std::fill_n(signs.begin() + part.slot, part.ops.size(), part.send ? 1 : -1);
  return signs;
}

template <class F>
void Executor::step(const std::string& kind, int32_t batch, StreamHandle s, F&& fn) {
  if (!trace_) {
    fn();
    return;
  }
  const EventHandle begin = device_->record(s, true);
  fn();
  marks_.push_back(Mark{kind, batch, begin, device_->record(s, true)});
}

void Executor::launch(int32_t table, int32_t cap, int32_t part, int32_t pass) {
  device_->launch(table, main_, cap, part < 0 ? -1 : parts_[static_cast<size_t>(part)].slot, pass);
}

void Executor::pack_step(int32_t b, int32_t cap) {
  if (verify_)
    launch(pack_[b], cap, 4 * b, RX_PASS_COPY);
  else
    launch(pack_[b], cap, -1, RX_PASS_NONE);
}

void Executor::digest_sends_step(int32_t b, int32_t cap) {
  // direct messages have no pack: their sources are read (read-only)
  if (verify_) launch(parts_[static_cast<size_t>(4 * b + 1)].table, cap, 4 * b + 1, RX_PASS_SRC);
}

void Executor::unpack_step(int32_t b, int32_t cap) {
  if (!verify_) {
    launch(unpack_[b], cap, -1, RX_PASS_NONE);
    return;
  }
  launch(unpack_[b], cap, 4 * b + 2, RX_PASS_COPY);
  if (!in_rounds(b))  // else digest_direct_recvs read them round by round
    launch(parts_[static_cast<size_t>(4 * b + 3)].table, cap, 4 * b + 3, RX_PASS_DST);
}

bool Executor::in_rounds(int32_t b) const {
  return verify_ && !round_messages_.empty() && !round_tables_[static_cast<size_t>(b)].empty();
}

void Executor::begin(StreamHandle main, bool verify, bool trace) {
  RX_HOST_ASSERT(tables_, "execute before prepare");
  RX_HOST_ASSERT(!verify || verify_built(), "verified execute before build_verify");
  try {
    drain();  // an execute whose caller never waited for its transfers
  } catch (const ReshardError&) {
    // That execute raised already; a failed drain left the transport aborted, which the
    // caller finds unusable and rebuilds before it posts anything.
  }
  main_ = main;
  verify_ = verify;
  trace_ = trace;
  marks_.clear();
  device_->begin();
  if (verify) device_->zero_digests(digest_slots_, main);
}

void Executor::pack_first() { step("pack", 0, main_, [&] { pack_step(0, cap()); }); }
void Executor::pack(int32_t b) { step("pack", b, main_, [&] { pack_step(b, 0); }); }
void Executor::digest_direct_sends(int32_t b) { digest_sends_step(b, 0); }
void Executor::copy(int32_t i) {
  step("copy", i, main_, [&] { launch(copy_[static_cast<size_t>(i)], 0, -1, RX_PASS_NONE); });
}
void Executor::unpack(int32_t b) { step("unpack", b, main_, [&] { unpack_step(b, 0); }); }

const Executor::Messages& Executor::messages(int32_t b, int32_t r, bool* whole) {
  const Messages& all = r < 0 ? messages_[static_cast<size_t>(b)] : round_messages_[static_cast<size_t>(b)][r];
  *whole = true;
  if (all_good_) return all;
  // Degraded: data still flows with the peers that agreed (they complete), but what
  // arrives for this rank lands in scratch memory, not in its tensors.
  auto good = [&](int32_t peer) { return std::binary_search(good_.begin(), good_.end(), peer); };
  auto staged = [&](uint64_t ptr) {
    return std::any_of(recv_staging_.begin(), recv_staging_.end(), [&](const std::pair<uint64_t, int64_t>& s) {
      return s.first <= ptr && ptr < s.first + static_cast<uint64_t>(s.second);
    });
  };
  Messages& out = degraded_;
  out.first.clear();
  out.second.clear();
  for (const Message& m : all.first)
    if (good(m.peer)) out.first.push_back(m);
  for (Message m : all.second) {
    if (!good(m.peer)) continue;
    if (!staged(m.ptr)) {
      m.ptr = device_->scratch(m.bytes);
      scratch_ = true;
    }
    out.second.push_back(m);
  }
  *whole = same(out.first, all.first) && same(out.second, all.second);
  return out;
}

void Executor::post(int32_t b) {
  const int32_t cap = this->cap();
  if (b > 0) step("pack", b, main_, [&] { pack_step(b, cap); });
  device_->wait_stream(side_, main_);  // the pack of b, and the unpack of b-2 (frees recv buffer b % 2)
  landed_.emplace_back();
  auto transfer = [&](int32_t r) {
    bool whole = true;
    const Messages& m = messages(b, r, &whole);
    if (r >= 0 && m.first.empty() && m.second.empty()) return;
    step(r < 0 ? "transfer" : "transfer r" + std::to_string(r), b, side_, [&] {
      transport_->post(b, r, m.first, m.second, side_, whole);
      if (post_hook_) post_hook_(b, r, side_, m.second);
    });
  };
  if (verify_ && !round_messages_.empty() && !round_messages_[static_cast<size_t>(b)].empty()) {
    for (size_t r = 0; r < round_messages_[static_cast<size_t>(b)].size(); ++r) {
      transfer(static_cast<int32_t>(r));
      landed_[b].push_back(device_->record(side_, false));
    }
    done_.push_back(landed_[b].back());
  } else {
    transfer(-1);
    done_.push_back(device_->record(side_, false));
  }
  // once the transfer is posted: direct sources are hashed beside the transport's reads
  if (verify_) step("digest", b, main_, [&] { digest_sends_step(b, cap); });
}

void Executor::digest_direct_recvs(int32_t b) {
  // Each round's pieces as soon as they landed, under the next round's transfer; only
  // the last round of the last batch runs alone, so at full width.
  const auto& per_round = round_tables_[static_cast<size_t>(b)];
  const int32_t k = num_batches();
  for (int32_t r = 0; r < static_cast<int32_t>(per_round.size()); ++r) {
    device_->wait_event(main_, landed_[b][r]);
    const int32_t c = (b + 1 == k && r + 1 == static_cast<int32_t>(per_round.size())) ? 0 : cap();
    step("digest r" + std::to_string(r), b, main_, [&] { launch(per_round[r], c, 4 * b + 3, RX_PASS_DST); });
  }
}

void Executor::run(const std::vector<int32_t>& good, bool writes, double timeout_s, bool defer_drain) {
  RX_HOST_ASSERT(transport_, "run without a transport");
  good_ = good;
  std::sort(good_.begin(), good_.end());
  all_good_ = writes && good_ == peers_;
  side_ = device_->side();
  done_.clear();
  landed_.clear();
  scratch_ = false;
  const int32_t k = num_batches();
  const int32_t cap = this->cap();
  const std::pair<double, double> t0 = time_host_ ? host_now() : std::pair<double, double>{};
  std::pair<double, double> t1 = t0;
  if (!good_.empty()) {
    post(0);
    for (int32_t b = 0; b < k; ++b) {
      if (b + 1 < k) post(b + 1);  // overlaps the transfer of b
      // This batch's slice of the same-rank copies runs under transfer b, after the pack of
      // b + 1 so that it never holds back the next transfer; one big copy up front would
      // leave the link idle. It hashes nothing, so a verified execute keeps the plain cap for
      // it: at full width it would hold SMs and HBM from the transfer as in a plain one.
      if (writes && b < num_copy_slices())
        step("copy", b, main_, [&] { launch(copy_[b], max_blocks_, -1, RX_PASS_NONE); });
      if (writes && in_rounds(b)) digest_direct_recvs(b);
      transport_->landed(b, main_, done_[b]);
      if (writes) step("unpack", b, main_, [&] { unpack_step(b, cap); });
      transport_->unpacked(b, main_);
    }
    // A dead peer or a lost message raises here (bounded by the execute's timeout)
    // instead of hanging the next sync.
    if (time_host_) t1 = host_now();
    drain_pending_ = true;
    drain_timeout_s_ = timeout_s;
    if (!defer_drain) drain();
  }
  if (time_host_) {
    const std::pair<double, double> t2 = good_.empty() ? t1 : host_now();
    last_run_times_ = {t1.first - t0.first, t1.second - t0.second, t2.first - t1.first, t2.second - t1.second};
  }
  // the scratch memory must outlive the transfers into it (kept on an exception: freed later)
  if (scratch_ && !drain_pending_) device_->release_scratch(main_);
}

void Executor::drain() {
  if (!drain_pending_) return;
  drain_pending_ = false;
  transport_->drain(main_, side_, drain_timeout_s_);
  if (scratch_) device_->release_scratch(main_);
}

std::vector<TraceRow> Executor::timeline() {
  std::vector<TraceRow> rows;
  if (marks_.empty()) return rows;
  device_->sync_event(marks_.back().end);
  const EventHandle t0 = marks_.front().begin;
  for (const Mark& m : marks_)
    rows.push_back(TraceRow{m.kind, m.batch, device_->elapsed_ms(t0, m.begin), device_->elapsed_ms(t0, m.end)});
  return rows;
}

void Executor::abort() {
  if (transport_) transport_->abort();
}

// --- recorders (CPU tests) ---------------------------------------------------------------

int32_t RecordingDevice::add_table(const std::vector<rx_box>& boxes, const std::string& name) {
  names_.push_back(name);
  boxes_.push_back(static_cast<int64_t>(boxes.size()));
  return static_cast<int32_t>(names_.size() - 1);
}

void RecordingDevice::launch(int32_t table, StreamHandle s, int32_t max_blocks, int64_t digest_slot, int32_t pass) {
  std::string line = name(s) + ": " + names_[static_cast<size_t>(table)];
  if (max_blocks) line += " cap " + std::to_string(max_blocks);
  if (digest_slot >= 0) line += " digest " + std::to_string(digest_slot) + " pass " + std::to_string(pass);
  log_->lines.push_back(line);
}

EventHandle RecordingDevice::record(StreamHandle s, bool timing) {
  const EventHandle e = static_cast<EventHandle>(++events_);
  if (at_.size() <= e) at_.resize(e + 1);
  at_[e] = log_->lines.size();
  if (!timing) log_->lines.push_back(name(s) + ": record e" + std::to_string(e));
  return e;
}

void RecordingDevice::wait_event(StreamHandle s, EventHandle e) {
  log_->lines.push_back(name(s) + ": wait e" + std::to_string(e));
}

void RecordingDevice::wait_stream(StreamHandle waiter, StreamHandle signaller) {
  log_->lines.push_back(name(waiter) + ": wait " + name(signaller));
}

double RecordingDevice::elapsed_ms(EventHandle a, EventHandle b) {
  return static_cast<double>(at_[b]) - static_cast<double>(at_[a]);
}

uint64_t RecordingDevice::scratch(int64_t bytes) {
  const uint64_t p = next_scratch_;
  next_scratch_ += static_cast<uint64_t>(std::max<int64_t>(bytes, 1));
  return p;
}

void RecordingDevice::release_scratch(StreamHandle s) { log_->lines.push_back(name(s) + ": synchronize"); }

namespace {

std::string describe(const std::vector<Message>& ms) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < ms.size(); ++i) o << (i ? ", " : "") << "(" << ms[i].peer << ", " << ms[i].bytes << ")";
  o << "]";
  return o.str();
}

}  // namespace

void RecordingTransport::post(int32_t batch, int32_t round, const std::vector<Message>& sends,
                              const std::vector<Message>& recvs, StreamHandle side, bool whole) {
  std::string line = RecordingDevice::name(side) + ": post " + std::to_string(batch);
  if (round >= 0) line += " r" + std::to_string(round);
  log_->lines.push_back(line + " sends " + describe(sends) + " recvs " + describe(recvs) + (whole ? "" : " partial"));
  received.insert(received.end(), recvs.begin(), recvs.end());
}

void RecordingTransport::landed(int32_t, StreamHandle main, EventHandle done) {
  log_->lines.push_back(RecordingDevice::name(main) + ": wait e" + std::to_string(done));
}

void RecordingTransport::drain(StreamHandle, StreamHandle, double) {
  log_->lines.push_back("host: drain");
  if (!fail_drain.empty()) throw ReshardError(fail_drain);
}

// --- host (CPU tests of the data path) ------------------------------------------------------

int32_t HostDevice::add_table(const std::vector<rx_box>& boxes, const std::string&) {
  tables_.push_back(boxes);
  return static_cast<int32_t>(tables_.size() - 1);
}

void HostDevice::launch(int32_t table, StreamHandle, int32_t, int64_t digest_slot, int32_t pass) {
  const std::vector<rx_box>& t = tables_[static_cast<size_t>(table)];
  const int64_t n = static_cast<int64_t>(t.size());
  if (digest_slot < 0) {
    RX_HOST_ASSERT(rx_copy_boxes_cpu(t.data(), n) == 0, "bad box in table");
    return;
  }
  // the GPU passes add into their slots (verify rounds add up a box's pieces), as digests add
  std::vector<uint64_t> d(t.size(), 0);
  RX_HOST_ASSERT(rx_digest_boxes_cpu(t.data(), n, pass, d.data()) == 0, "bad box in table");
  for (size_t k = 0; k < d.size(); ++k) {
    uint64_t& slot = digests_[digest_slot + static_cast<int64_t>(k)];
    slot = digest::add(slot, d[k]);
  }
}

void HostDevice::zero_digests(int64_t slots, StreamHandle) {
  if (slots > 0) std::memset(digests_, 0, static_cast<size_t>(slots) * sizeof(uint64_t));
}

uint64_t HostDevice::scratch(int64_t bytes) {
  scratch_.emplace_back(static_cast<size_t>(std::max<int64_t>(bytes, 1)));
  return reinterpret_cast<uint64_t>(scratch_.back().data());
}

namespace {

// The side stream of a host device runs each post at once: the sends are copied out, then
// the receives wait for their peers' posts (every rank posts in the same order, sends first).
class HostTransport : public Transport {
 public:
  HostTransport(std::shared_ptr<HostFabric> fabric, int rank, bool rounds, double timeout_s)
      : fabric_(std::move(fabric)), rank_(rank), rounds_(rounds), timeout_s_(timeout_s) {}
  void post(int32_t, int32_t, const std::vector<Message>& sends, const std::vector<Message>& recvs, StreamHandle,
            bool) override {
    for (const Message& m : sends)
      if (m.bytes > 0) fabric_->put(rank_, m.peer, m);
    for (const Message& m : recvs)
      if (m.bytes > 0) fabric_->take(m.peer, rank_, m, timeout_s_);
  }
  void landed(int32_t, StreamHandle, EventHandle) override {}
  void drain(StreamHandle, StreamHandle, double) override {}
  bool rounds() const override { return rounds_; }

 private:
  std::shared_ptr<HostFabric> fabric_;
  int rank_;
  bool rounds_;
  double timeout_s_;
};

}  // namespace

std::shared_ptr<Transport> HostFabric::transport(int rank, bool rounds, double timeout_s) {
  RX_HOST_ASSERT(rank >= 0 && rank < world_, "rank ", rank, " of ", world_);
  return std::make_shared<HostTransport>(shared_from_this(), rank, rounds, timeout_s);
}

void HostFabric::put(int from, int to, const Message& m) {
  const char* p = reinterpret_cast<const char*>(m.ptr);
  std::vector<char> bytes(p, p + m.bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    queues_[{from, to}].push_back(std::move(bytes));
  }
  cv_.notify_all();
}

void HostFabric::take(int from, int to, const Message& m, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  auto& q = queues_[{from, to}];
  if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return !q.empty(); }))
    throw ReshardError(detail::format("host transport: rank ", to, " got no message from rank ", from, " within ",
                                      timeout_s, " s"));
  std::vector<char> bytes = std::move(q.front());
  q.pop_front();
  lock.unlock();
  if (static_cast<int64_t>(bytes.size()) != m.bytes)
    throw ReshardError(detail::format("host transport: rank ", to, " expected ", m.bytes, " bytes from rank ", from,
                                      ", got ", bytes.size()));
  std::memcpy(reinterpret_cast<void*>(m.ptr), bytes.data(), bytes.size());
}

// --- CUDA ----------------------------------------------------------------------------------
#ifdef RX_WITH_CUDA
namespace {

cudaStream_t as_stream(StreamHandle s) { return reinterpret_cast<cudaStream_t>(s); }
cudaEvent_t as_event(EventHandle e) { return reinterpret_cast<cudaEvent_t>(e); }

class CudaDevice : public Device {
 public:
  explicit CudaDevice(int device) : device_(device) {
    DeviceGuard guard(device_);
    int lo = 0, hi = 0;
    RX_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    // High priority (-1, as torch.cuda.Stream(priority=-1)): the transfer is the critical path;
    // packs and unpacks on the caller's stream fill the SMs the transport leaves idle.
    RX_CUDA_CHECK(cudaStreamCreateWithPriority(&side_, cudaStreamNonBlocking, std::max(hi, -1)));
  }
  ~CudaDevice() override {
    for (cudaEvent_t e : plain_) cudaEventDestroy(e);
    for (cudaEvent_t e : timing_) cudaEventDestroy(e);
    for (void* p : scratch_) cudaFree(p);
    if (side_) cudaStreamDestroy(side_);
  }
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  void clear_tables() override {
    tables_.clear();
    uploaded_ = 0;
    digests_ = nullptr;
  }
  int32_t add_table(const std::vector<rx_box>& boxes, const std::string&) override {
    tables_.emplace_back(boxes);
    return static_cast<int32_t>(tables_.size() - 1);
  }
  int64_t num_boxes(int32_t table) const override { return tables_[static_cast<size_t>(table)].num_boxes(); }
  int64_t pending_bytes() const override {
    int64_t total = 0;
    for (size_t i = uploaded_; i < tables_.size(); ++i) total += align(tables_[i].bytes_needed());
    return total;
  }
  void upload(uint64_t dev, StreamHandle stream) override {
    int64_t off = 0;
    for (; uploaded_ < tables_.size(); ++uploaded_) {
      tables_[uploaded_].upload(reinterpret_cast<void*>(dev + static_cast<uint64_t>(off)), as_stream(stream));
      off += align(tables_[uploaded_].bytes_needed());
    }
    // execute may run on another stream than this one: finish the uploads here, at plan
    // time, rather than order every later launch after them.
    RX_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  }
  void launch(int32_t table, StreamHandle s, int32_t max_blocks, int64_t digest_slot, int32_t pass) override {
    const DeviceBoxTable& t = tables_[static_cast<size_t>(table)];
    if (digest_slot < 0)
      t.launch(as_stream(s), max_blocks);
    else
      t.launch_digest(as_stream(s), max_blocks, digests_ + digest_slot, pass);
  }
  void set_digests(uint64_t dev) override { digests_ = reinterpret_cast<uint64_t*>(dev); }
  void zero_digests(int64_t slots, StreamHandle s) override {
    if (slots > 0)
      RX_CUDA_CHECK(cudaMemsetAsync(digests_, 0, static_cast<size_t>(slots) * sizeof(uint64_t), as_stream(s)));
  }
  StreamHandle side() override { return reinterpret_cast<StreamHandle>(side_); }
  EventHandle record(StreamHandle s, bool timing) override {
    std::vector<cudaEvent_t>& pool = timing ? timing_ : plain_;
    size_t& used = timing ? timing_used_ : plain_used_;
    if (used == pool.size()) {
      DeviceGuard guard(device_);  // an event records only on streams of its device
      cudaEvent_t e;
      RX_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
      pool.push_back(e);
    }
    cudaEvent_t e = pool[used++];
    RX_CUDA_CHECK(cudaEventRecord(e, as_stream(s)));
    return reinterpret_cast<EventHandle>(e);
  }
  void wait_event(StreamHandle s, EventHandle e) override {
    RX_CUDA_CHECK(cudaStreamWaitEvent(as_stream(s), as_event(e), 0));
  }
  void wait_stream(StreamHandle waiter, StreamHandle signaller) override {
    if (waiter == signaller) return;
    const EventHandle e = record(signaller, false);
    wait_event(waiter, e);
  }
  void begin() override { plain_used_ = timing_used_ = 0; }
  void sync_event(EventHandle e) override { RX_CUDA_CHECK(cudaEventSynchronize(as_event(e))); }
  double elapsed_ms(EventHandle a, EventHandle b) override {
    float ms = 0;
    RX_CUDA_CHECK(cudaEventElapsedTime(&ms, as_event(a), as_event(b)));
    return ms;
  }
  uint64_t scratch(int64_t bytes) override {
    DeviceGuard guard(device_);
    void* p = nullptr;
    RX_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(bytes, 1))));
    scratch_.push_back(p);
    return reinterpret_cast<uint64_t>(p);
  }
  void release_scratch(StreamHandle s) override {
    RX_CUDA_CHECK(cudaStreamSynchronize(as_stream(s)));
    for (void* p : scratch_) RX_CUDA_CHECK(cudaFree(p));
    scratch_.clear();
  }

 private:
  static int64_t align(int64_t n) { return (n + 255) / 256 * 256; }

  int device_;
  cudaStream_t side_ = nullptr;
  std::vector<DeviceBoxTable> tables_;
  size_t uploaded_ = 0;
  uint64_t* digests_ = nullptr;
  std::vector<cudaEvent_t> plain_, timing_;  // reused by every execute (begin)
  size_t plain_used_ = 0, timing_used_ = 0;
  std::vector<void*> scratch_;
};

// NVSHMEM: puts with signals on the side stream, flow control on the GPU.
class NvshmemTransport : public Transport {
 public:
  explicit NvshmemTransport(std::shared_ptr<NvshmemExchange> puts) : puts_(std::move(puts)) {}
  void post(int32_t batch, int32_t, const std::vector<Message>&, const std::vector<Message>&, StreamHandle side,
            bool whole) override {
    if (!whole)  // the puts are fixed per plan, so none are sent
      throw ReshardError(
          "NVSHMEM transfer: a peer refused this execute (see its error); the plan's batches cannot run with part "
          "of its peers");
    puts_->send(batch, as_stream(side));
  }
  void landed(int32_t batch, StreamHandle main, EventHandle done) override {
    // our own put of b read the send slot the pack of b + 2 rewrites
    RX_CUDA_CHECK(cudaStreamWaitEvent(as_stream(main), as_event(done), 0));
    puts_->wait(batch, as_stream(main));
  }
  void unpacked(int32_t batch, StreamHandle main) override { puts_->release(batch, as_stream(main)); }
  void drain(StreamHandle main, StreamHandle side, double timeout_s) override {
    stream_wait(as_stream(main), as_stream(side));
    puts_->wait_idle(as_stream(main), timeout_s);
  }

 private:
  std::shared_ptr<NvshmemExchange> puts_;
};

}  // namespace

std::unique_ptr<Device> make_cuda_device(int device) { return std::make_unique<CudaDevice>(device); }

std::shared_ptr<Transport> make_nvshmem_transport(std::shared_ptr<NvshmemExchange> puts) {
  return std::make_shared<NvshmemTransport>(std::move(puts));
}
#endif  // RX_WITH_CUDA

#ifdef RX_WITH_NCCL
namespace {

// NCCL: one grouped send/recv per post, on the side stream; the host waits once per execute.
class NcclTransport : public Transport {
 public:
  explicit NcclTransport(std::shared_ptr<NcclComm> comm) : comm_(std::move(comm)) {}
  void post(int32_t, int32_t, const std::vector<Message>& sends, const std::vector<Message>& recvs,
            StreamHandle side, bool) override {
    comm_->exchange(transfers(sends, &send_), transfers(recvs, &recv_), as_stream(side), nullptr);
  }
  void landed(int32_t, StreamHandle main, EventHandle done) override {
    RX_CUDA_CHECK(cudaStreamWaitEvent(as_stream(main), as_event(done), 0));
  }
  void drain(StreamHandle, StreamHandle, double timeout_s) override { comm_->wait(timeout_s); }
  void abort() override { comm_->abort(); }
  bool rounds() const override { return true; }

 private:
  static const std::vector<NcclTransfer>& transfers(const std::vector<Message>& ms, std::vector<NcclTransfer>* out) {
    out->clear();
    for (const Message& m : ms) out->push_back(NcclTransfer{m.peer, m.ptr, m.bytes});
    return *out;
  }
  std::shared_ptr<NcclComm> comm_;
  std::vector<NcclTransfer> send_, recv_;
};

}  // namespace

std::shared_ptr<Transport> make_nccl_transport(std::shared_ptr<NcclComm> comm) {
  return std::make_shared<NcclTransport>(std::move(comm));
}
#endif  // RX_WITH_NCCL

}  // namespace rx
