// A sub-group carved out of an existing group with no rendezvous of its own: its collectives are
// point-to-point calls on the parent group's transport between the members only (the parent's
// other ranks take no part and need not call anything). For groups made where no store is at
// hand, e.g. the Ulysses and co groups of a CP topology over a torch.distributed group handed
// in from Python (cp::CPTopology::from_group).
//
// What each collective hands the parent's transport (per member, n = this member's buffer):
//   all_gather    its input to every other member                  (P-1) n, as a ring would
//   all_to_all    chunk j to member j                              (P-1)/P n
//   all_to_all_v  its rows for member j to member j
//   all_reduce    an all_gather of the buffers, reduced locally     (P-1) n
//   send / recv   the parent's, to/from the member's parent rank
//   barrier       an all_gather of one byte per member
// Tags live in a range of their own above the parent's point-to-point tags (a slot per sub-group,
// then a sequence per sub-group), so a sub-group's messages never match the parent's or another
// sub-group's, even one with the same members. Gloo (or any backend that matches point-to-point
// calls by tag); an nccl parent is refused. Same-order contract: the members issue the same
// calls on a sub-group in the same order.
#pragma once

#include <string>
#include <vector>

#include "hp/comm/group.h"

namespace hp::comm {

// `parent_ranks`: the members as ranks of `parent` (in the sub-group's rank order; distinct, in
// range). No communication, but ordered: every rank of the parent calls it for every sub-group,
// in the same order (members and not; a non-member gets null), so the same sub-group gets the
// same tag slot on all its members. At most 1024 sub-groups per parent. A
// sub-group of one rank is a self group. The sub-group shares the parent's CommContext (its
// bytes count there) and timeout, and keeps the parent alive.
GroupPtr make_subgroup(const GroupPtr& parent, const std::vector<int>& parent_ranks,
                       const std::string& name);

}  // namespace hp::comm
