// Plan-level context-parallel configuration (DESIGN section 5.1) and its static checks.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace hp::cp {

class StrategyRegistry;  // strategy.h

// A CP strategy by name: a key of a StrategyRegistry (strategy.h). The built-in names have
// constants; a strategy added to a registry is named by its own string.
class CPAlgorithm {
 public:
  static constexpr const char* kAllGather = "all_gather";
  static constexpr const char* kUlysses = "ulysses";
  static constexpr const char* kHybrid = "hybrid";
  static constexpr const char* kRing = "ring";
  static constexpr const char* kUsp = "usp";

  CPAlgorithm(const char* name = kAllGather) : name_(name) {}  // NOLINT: implicit by design
  CPAlgorithm(std::string name) : name_(std::move(name)) {}    // NOLINT: implicit by design
  const std::string& name() const { return name_; }

  friend bool operator==(const CPAlgorithm& a, const CPAlgorithm& b) { return a.name_ == b.name_; }
  friend bool operator!=(const CPAlgorithm& a, const CPAlgorithm& b) { return a.name_ != b.name_; }
  friend std::ostream& operator<<(std::ostream& os, const CPAlgorithm& a) { return os << a.name_; }

 private:
  std::string name_;
};
enum class CPSchedule { kSync, kAsync };
enum class AsyncFallback { kError, kSync };
// Head-tail load balance comes in two forms (DESIGN section 5.4):
//   kDataOrder    the data was sharded by shard_sequence(..., load_balance = true): rank r holds
//                 chunks {2r, 2P-2r-1}; the gathered K/V are put back in natural order;
//   kRuntimeSwap  contiguous data; rank r swaps its second query half with mirror rank P-1-r,
//                 runs two sub-attentions and swaps the outputs back.
enum class LoadBalanceForm { kDataOrder, kRuntimeSwap };

// K/V heads fewer than the Ulysses degree U: kError refuses (the default); kRepeat hands every
// rank of the Ulysses group, in the K/V all-to-all, only the one K/V head its query heads read
// (head j to ranks j U / kv_heads ..), so a position of one head leaves a rank once per reader
// and no rank receives a head it does not read. Needs U % kv_heads == 0.
enum class KVHeadPolicy { kError, kRepeat };

// What the ring's backward (ring and usp) passes around the ring (volume.h has the bytes):
//   kBlocks   each rank's [k | v] block again, followed by its dK/dV accumulator (the forward's
//             direction);
//   kQueries  each rank's [q | dout] and [lse | rowsum(dout * out)] the other way, followed by
//             its dQ accumulator; dK/dV never leave their rank. Fewer bytes where the query heads'
//             Q, dO and dQ weigh less than two passes of K/V: multi-head attention at D = 64
//             sends (3D + 2) per head against 4D;
//   kAuto     whichever of the two sends fewer bytes for the call's shapes (kBlocks on a tie).
// Kept blocks (ring_keep_blocks) send only the dK/dV accumulators, fewer than either: the
// queries stay home there.
enum class RingBackward { kAuto, kBlocks, kQueries };

struct ContextParallelConfig {
  CPAlgorithm algorithm = CPAlgorithm::kAllGather;
  CPSchedule schedule = CPSchedule::kSync;
  std::optional<int64_t> ulysses_degree;  // ulysses: cp (default); hybrid: required, in (1, cp)
  bool load_balance = false;  // head-tail balance (strategies with supports_load_balance())
  LoadBalanceForm load_balance_form = LoadBalanceForm::kDataOrder;
  AsyncFallback async_fallback = AsyncFallback::kError;
  KVHeadPolicy kv_head_policy = KVHeadPolicy::kError;
  // Async ulysses, hybrid and usp: this rank's heads (after the all-to-all) split into this
  // many groups, each group's output all-to-all flying while the next group is attended (usp: a
  // ring per group; forward and backward; ulysses and hybrid: Q, K, V travel in one all-to-all
  // per group too, and hybrid's co-group K/V gathers run per group). Async all_gather: K/V
  // gathered in this many head groups, each group's remote keys attended while the later
  // groups' K/V travel (backward: each group's dK/dV reduce-scattered as soon as its backward
  // is done).
  // 0: automatic (ulysses, hybrid: the largest of 4, 3, 2 that divides the rank's query and K/V
  // heads, else 1; all_gather: the largest count up to 8 (4 at cp_size 2) that divides them;
  // usp: 2 where it divides them and each rank holds at least kUspMinRowsForHeadGroups tokens,
  // else 1, since each group costs a ring of its own);
  // 1: one group (the output all-to-all after all of attention).
  // K/V on the repeat path (kv_head_policy=repeat): ulysses and hybrid split the query heads
  // alone (each rank's one K/V head is shared by every group and travels whole); usp runs one
  // group there (a larger count is refused).
  int64_t ulysses_head_groups = 0;
  // Async all_gather and hybrid: a query part whose turn comes after the K/V all-gather (hybrid:
  // the co-group gather) has landed attends all its keys in one call, as sync does (false, the
  // default: the split into local and remote calls merged by log-sum-exp only pays while there
  // is something to hide), or still attends the local chunks first and the rest after (true).
  bool async_always_local_first = false;
  // Ring and usp: forward keeps every K/V block that arrives, so the backward sends only the
  // dK/dV accumulators around the ring, not the blocks again: the bytes of all_gather (2(C-1)
  // blocks per step instead of 3(C-1)) with the ring's overlap, for the memory of all_gather
  // (the co group's whole K/V instead of at most two blocks). false (the default): at most two
  // blocks alive, the blocks travel again in backward.
  bool ring_keep_blocks = false;
  // Ring and usp: what the backward passes around the ring (RingBackward; kQueries is refused
  // with ring_keep_blocks).
  RingBackward ring_backward = RingBackward::kAuto;
  // Async ulysses: the last head group's output all-to-all in this many row parts (each rank's
  // chunk cut into equal row ranges; part m attended for every chunk, then sent while part m + 1
  // is attended), so what nothing hides at the end of forward and the start of backward is one
  // part's all-to-all, not the whole group's. Each part costs one attention call per chunk.
  // 0: automatic (2 where each part keeps at least 2048 rows, else 1: measured on the 1 Gbit/s
  // link, 2 parts exposed 0.06 s less at P = 4, S = 16384 and cost 0.035 s at S = 4096, where
  // each part is 512 rows; docs/benchmarks.md); 1: the group's output in one all-to-all.
  int64_t ulysses_row_parts = 0;
};

const std::string& to_string(const CPAlgorithm& a);  // the strategy name
const char* to_string(CPSchedule s);                 // "sync", "async"
const char* to_string(AsyncFallback f);              // "error", "sync"
const char* to_string(LoadBalanceForm f);            // "data_order", "runtime_swap"
const char* to_string(KVHeadPolicy p);               // "error", "repeat"
const char* to_string(RingBackward b);               // "auto", "blocks", "queries"

// Parse the string forms; errors list the valid values. Algorithms are the names of
// `strategies` (null: StrategyRegistry::builtin()).
CPAlgorithm parse_algorithm(const std::string& s, const StrategyRegistry* strategies = nullptr);
CPSchedule parse_schedule(const std::string& s);
AsyncFallback parse_async_fallback(const std::string& s);
KVHeadPolicy parse_kv_head_policy(const std::string& s);
RingBackward parse_ring_backward(const std::string& s);

// The one legacy conversion from a bare Ulysses degree: 1 -> all_gather, == cp -> ulysses,
// in between -> hybrid with that degree.
ContextParallelConfig from_legacy_degree(int64_t degree, int64_t cp_size);

// A CP configuration as a command line gives it: names and numbers, not yet checked. The tools'
// argument structs derive from it; parse_flags() checks the names and builds the configuration.
struct CPFlags {
  std::string algo = "all_gather";       // --cp-algo: a strategy's name
  std::string schedule = "sync";         // --schedule
  int64_t degree = 0;                    // --ulysses-degree; 0: the strategy's
  bool load_balance = false;             // --load-balance
  std::string kv_head_policy = "error";  // --kv-head-policy
  int64_t head_groups = 0;               // --ulysses-head-groups
  int64_t row_parts = 0;                 // --ulysses-row-parts
  bool ring_keep_blocks = false;         // --ring-keep-blocks
  std::string ring_backward = "auto";    // --ring-backward
};
// The configuration `flags` name (throws hp::Error listing the valid names for an unknown one);
// the load balance form and the async fallback stay at their defaults.
ContextParallelConfig parse_flags(const CPFlags& flags);

// The settings of `c` that differ from a default ContextParallelConfig, each written as the
// tools' flag ("--cp-algo ring", "--load-balance", "--ulysses-head-groups 2", ...); the load
// balance form is left to the tool (it has no meaning without --load-balance, listed itself).
std::vector<std::string> settings_given(const ContextParallelConfig& c);
// Throws hp::Error naming `given` (settings_given() and the tool's own CP flags) when it is not
// empty: with --cp 1 no CP runs (`what_runs` says what does, e.g. "the plain layer runs"), so
// none of them would do anything. `tool` prefixes the message.
void check_nothing_given_without_cp(const std::string& tool, const std::vector<std::string>& given,
                                    const std::string& what_runs);

// Normalisation: cp_size == 1 -> nullopt (CP ignored); cp_size > 1 without a config ->
// all_gather + sync; otherwise the config with ulysses_degree filled in by its strategy
// (ulysses: cp_size; all_gather: 1). Runs every static check that needs only the config and
// cp_size: the algorithm is a name of `strategies` (null: the built-in registry), the strategy's
// own checks (CPStrategy::normalize: cp_size % ulysses_degree, ulysses degree == cp, hybrid
// degree in (1, cp)), load_balance only with a strategy that supports it. At cp_size 1 a given
// config still gets the checks that need no cp_size (names, options that apply to other
// strategies or schedules, load_balance), so code run on one rank first is refused there, not
// only once it runs on P ranks.
std::optional<ContextParallelConfig> normalize(const std::optional<ContextParallelConfig>& config,
                                               int64_t cp_size,
                                               const StrategyRegistry* strategies = nullptr);

// Effective degrees of a normalised config (the Ulysses degree it filled in; 1 when unset).
int64_t ulysses_degree_of(const ContextParallelConfig& c, int64_t cp_size);
// The head groups async ulysses, hybrid, usp or all_gather runs with nq query and nkv K/V
// heads per rank (after the all-to-all; all_gather: all of them): c.ulysses_head_groups when
// set (the strategy checks that it divides both), else for usp 2 (1 where 2 does not divide
// both, or where `local_seq`, the rank's tokens before the all-to-all, is known (> 0) and below
// kUspMinRowsForHeadGroups), for all_gather over `cp_size` ranks the largest count up to min(8, 2
// cp_size) that divides both (0: unknown size, up to 8), else the largest of 4, 3, 2 that divides
// both, else 1.
inline constexpr int64_t kUspMinRowsForHeadGroups = 4096;
int64_t ulysses_head_groups_of(const ContextParallelConfig& c, int64_t nq, int64_t nkv,
                               int64_t cp_size = 0, int64_t local_seq = 0);
int64_t colossal_degree_of(const ContextParallelConfig& c, int64_t cp_size);
// The row parts of async ulysses' last head group for a rank's `local_seq` rows:
// c.ulysses_row_parts when set (at most local_seq), else 2 where each part keeps at least
// kUlyssesMinRowsPerPart rows, else 1.
inline constexpr int64_t kUlyssesMinRowsPerPart = 2048;
int64_t ulysses_row_parts_of(const ContextParallelConfig& c, int64_t local_seq);

// Head divisibility with the local head counts after TP (a Ulysses degree U > 1 needs q and kv
// heads divisible by U; K/V heads fewer than U only with kv_head_policy=repeat and U % kv == 0;
// never a silent repeat).
void check_heads(const ContextParallelConfig& c, int64_t cp_size, int64_t local_q_heads,
                 int64_t local_kv_heads, int64_t tp_size = 1);
// The same rule by degree; `algorithm` names the strategy in the message.
void check_heads_for_degree(const std::string& algorithm, int64_t ulysses_degree,
                            int64_t local_q_heads, int64_t local_kv_heads, int64_t tp_size = 1,
                            KVHeadPolicy policy = KVHeadPolicy::kError);
// Whether K/V with `kv_heads` heads travel by the repeat path (policy repeat, kv % U != 0).
bool repeats_kv(KVHeadPolicy policy, int64_t ulysses_degree, int64_t kv_heads);

// The global sequence length must split into cp equal shards (2*cp with load balance).
void check_sequence(const ContextParallelConfig& c, int64_t cp_size, int64_t global_seq_len);

std::string describe(const ContextParallelConfig& c, int64_t cp_size);

}  // namespace hp::cp
