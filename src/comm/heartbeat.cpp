#include "heartbeat.h"

#include <vector>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "hp/comm/store.h"
#include "hp/comm/traffic.h"
#include "hp/common/check.h"

namespace hp::comm::detail {

namespace {

// How long a failing rank waits to reach the store before it calls the store's host lost.
constexpr std::chrono::milliseconds kProbeJoinTimeout{3000};

std::vector<uint8_t> bytes_of(const std::string& s) {
  return {s.begin(), s.end()};
}

// The value under `key`, or "" when there is none (never blocks on a missing key).
std::string read_key(c10d::TCPStore& store, const std::string& key) {
  if (!store.check({key})) return "";
  const auto v = store.get(key);
  return {v.begin(), v.end()};
}

}  // namespace

Heartbeat::Heartbeat(HeartbeatTarget target, std::chrono::milliseconds interval,
                     std::shared_ptr<CommContext> context)
    : thread_([this, target = std::move(target), interval, context = std::move(context)] {
        run(target, interval, *context);
      }) {}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Heartbeat::run(const HeartbeatTarget& target, std::chrono::milliseconds interval,
                    const CommContext& context) {
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    store = join_store(target.store_host, target.store_port, std::chrono::seconds(10));
    if (!target.transport_addr.empty())
      store->set(transport_addr_key(target.rank), bytes_of(target.transport_addr));
  } catch (const std::exception&) {
    return;
  }
  const std::string key = heartbeat_key(target.rank);
  int64_t beat = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    lock.unlock();
    const std::string value =
        common::str_cat(++beat, " ", context.ops_launched.load(std::memory_order_relaxed));
    try {
      store->set(key, bytes_of(value));
    } catch (const std::exception&) {
      return;  // the store is gone; so is the job
    }
    lock.lock();
    cv_.wait_for(lock, interval, [this] { return stop_; });
  }
}

std::string diagnose_lost_peers(const HeartbeatTarget& target) {
  const std::string store_at = common::str_cat(target.store_host, ":", target.store_port);
  try {
    auto store = join_store(target.store_host, target.store_port, kProbeJoinTimeout);
    std::vector<std::string> before(target.world_size);
    for (int r = 0; r < target.world_size; ++r)
      if (r != target.rank) before[r] = read_key(*store, heartbeat_key(r));
    std::this_thread::sleep_for(kHeartbeatStale);
    std::string lost;
    int n_lost = 0;
    for (int r = 0; r < target.world_size; ++r) {
      if (r == target.rank || read_key(*store, heartbeat_key(r)) != before[r]) continue;
      const std::string addr = read_key(*store, transport_addr_key(r));
      lost += common::str_cat(n_lost++ == 0 ? "" : ", ", "rank ", r,
                              addr.empty() ? "" : common::str_cat(" (", addr, ")"));
    }
    if (n_lost == 0) {
      return "every peer still sends heartbeats to the store at " + store_at +
             " (a peer is slow or stuck in its own code, not gone)";
    }
    return common::str_cat("lost peer", n_lost > 1 ? "s " : " ", lost, ": no heartbeat in ",
                           kHeartbeatStale.count(), " ms at the store ", store_at);
  } catch (const std::exception&) {
    return common::str_cat("lost peer rank 0's host ", target.store_host, ": the job's store at ",
                           store_at, " cannot be reached from rank ", target.rank, " within ",
                           kProbeJoinTimeout.count(), " ms");
  }
}

}  // namespace hp::comm::detail
