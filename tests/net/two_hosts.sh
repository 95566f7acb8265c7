#!/usr/bin/env bash
# Two "hosts" over a real network path (issue 13): two network namespaces joined by a veth pair,
# 10.77.0.1 and 10.77.0.2, two ranks in each, started the way torchrun starts them (RANK,
# WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR = the first namespace's address).
#
#   two_hosts.sh HP_TRAIN train      hp-train with CP 4 across the link (all_gather, hybrid), each
#                                    checked against its single-process --validate reference
#   two_hosts.sh HP_TRAIN link-down  the link is taken down mid-run: every rank exits non-zero
#                                    within the group timeout (plus the diagnosis), naming the
#                                    peer it lost
#
# Needs root (ip netns); exits 77 (ctest: skipped) with a message otherwise. Only the two
# namespaces and the veth pair inside them are created; nothing touches the host's interfaces.
# The namespaces (and with them the veth pair) are removed, and the ranks ended by their pids,
# however the test ends.
set -euo pipefail

HP_TRAIN=${1:?usage: two_hosts.sh HP_TRAIN train|link-down}
MODE=${2:?usage: two_hosts.sh HP_TRAIN train|link-down}
TIMEOUT_S=10  # --timeout of the link-down run

skip() {
  echo "SKIPPED: $*" >&2
  exit 77
}
[ "$(id -u)" -eq 0 ] || skip "two-host test needs root (ip netns); run it as root"
command -v ip > /dev/null || skip "two-host test needs the ip command (iproute2; scripts/setup.sh installs it)"

NS_A="hp2h-a-$$"
NS_B="hp2h-b-$$"
VETH_A="hp2ha$$"
VETH_B="hp2hb$$"
WORK=$(mktemp -d)
PIDS=()

cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do
    kill -9 "$pid" 2> /dev/null || true
  done
  ip netns del "$NS_A" 2> /dev/null || true
  ip netns del "$NS_B" 2> /dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

fail() {
  echo "FAILED: $*" >&2
  local f
  for f in "$WORK"/*.log; do
    [ -e "$f" ] || continue
    echo "--- $(basename "$f")" >&2
    tail -n 20 "$f" >&2
  done
  exit 1
}

ip netns add "$NS_A" 2> /dev/null || skip "cannot create a network namespace here (ip netns add failed)"
ip netns add "$NS_B"
ip link add "$VETH_A" type veth peer name "$VETH_B"
ip link set "$VETH_A" netns "$NS_A"
ip link set "$VETH_B" netns "$NS_B"
ip -n "$NS_A" addr add 10.77.0.1/24 dev "$VETH_A"
ip -n "$NS_B" addr add 10.77.0.2/24 dev "$VETH_B"
for ns in "$NS_A" "$NS_B"; do
  ip -n "$ns" link set lo up
done
ip -n "$NS_A" link set "$VETH_A" up
ip -n "$NS_B" link set "$VETH_B" up

MODEL=(--seq-len 64 --layers 1 --hidden 64 --heads 4 --kv-heads 2 --head-dim 16 --ffn 128)

# start_ranks NAME ARGS...: ranks 0-1 in namespace A, 2-3 in B; their pids in PIDS, logs in
# $WORK/NAME.rank<r>.log.
start_ranks() {
  local name=$1 r ns local_rank
  shift
  PIDS=()
  for r in 0 1 2 3; do
    ns=$NS_A
    local_rank=$r
    if [ "$r" -ge 2 ]; then
      ns=$NS_B
      local_rank=$((r - 2))
    fi
    ip netns exec "$ns" env RANK=$r WORLD_SIZE=4 LOCAL_RANK=$local_rank LOCAL_WORLD_SIZE=2 \
      MASTER_ADDR=10.77.0.1 MASTER_PORT=29650 OPENBLAS_NUM_THREADS=1 \
      "$HP_TRAIN" "$@" > "$WORK/$name.rank$r.log" 2>&1 &
    PIDS+=($!)
  done
}

now_ms() { date +%s%3N; }

# wait_ranks SECONDS: waits for every rank; fails naming the ranks still running after SECONDS.
# RCS[r] and EXIT_MS[r] (since the epoch) are filled in.
wait_ranks() {
  local deadline=$(($(now_ms) + $1 * 1000)) r left
  RCS=(x x x x)
  EXIT_MS=(0 0 0 0)
  while :; do
    left=0
    for r in 0 1 2 3; do
      [ "${RCS[$r]}" = x ] || continue
      if kill -0 "${PIDS[$r]}" 2> /dev/null; then
        left=$((left + 1))
      else
        set +e
        wait "${PIDS[$r]}"
        RCS[$r]=$?
        set -e
        EXIT_MS[$r]=$(now_ms)
      fi
    done
    [ "$left" -eq 0 ] && return 0
    if [ "$(now_ms)" -gt "$deadline" ]; then
      fail "ranks still running after $1 s: rcs ${RCS[*]} (x = running)"
    fi
    sleep 0.1
  done
}

train_across_the_link() {
  local algo_args=("$@") name="train_${1#--cp-algo=}" line loss grad
  start_ranks "$name" --cp 4 "${algo_args[@]}" --steps 3 "${MODEL[@]}" --validate --timeout 60
  wait_ranks 180
  for r in 0 1 2 3; do
    [ "${RCS[$r]}" -eq 0 ] || fail "${algo_args[*]}: rank $r exited ${RCS[$r]}"
  done
  line=$(grep "hp-train: validate:" "$WORK/$name.rank0.log") ||
    fail "${algo_args[*]}: no validate line from rank 0"
  loss=$(sed -E 's/.*steps = ([^;]+);.*/\1/' <<< "$line")
  grad=$(sed -E 's/.*step 1 = (.*)$/\1/' <<< "$line")
  awk -v l="$loss" -v g="$grad" 'BEGIN { exit !(l < 1e-4 && g < 1e-3) }' ||
    fail "${algo_args[*]}: distributed run differs from the single-process reference: $line"
  grep -q "hp-train: done:" "$WORK/$name.rank0.log" || fail "${algo_args[*]}: no done line"
  echo "ok: CP 4 over two hosts, ${algo_args[*]}: $line"
}

link_down_mid_run() {
  local name=linkdown r t_down log elapsed_ms limit_ms
  start_ranks "$name" --cp 4 --cp-algo=hybrid --ulysses-degree 2 --steps 100000 "${MODEL[@]}" \
    --timeout "$TIMEOUT_S"
  for _ in $(seq 600); do
    grep -q "step 1/" "$WORK/$name.rank0.log" && break
    kill -0 "${PIDS[0]}" 2> /dev/null || fail "rank 0 ended before training"
    sleep 0.1
  done
  grep -q "step 1/" "$WORK/$name.rank0.log" || fail "no training step within 60 s"
  sleep 1
  t_down=$(now_ms)
  ip -n "$NS_A" link set "$VETH_A" down
  # The group timeout, then the diagnosis (a store probe of at most 3 s, 1.5 s of heartbeats).
  limit_ms=$(((TIMEOUT_S + 15) * 1000))
  wait_ranks 60
  for r in 0 1 2 3; do
    log="$WORK/$name.rank$r.log"
    elapsed_ms=$((EXIT_MS[r] - t_down))
    [ "${RCS[$r]}" -ne 0 ] || fail "rank $r exited 0 after the link went down"
    [ "$elapsed_ms" -le "$limit_ms" ] ||
      fail "rank $r took $elapsed_ms ms to exit after the link went down (limit $limit_ms ms)"
    if [ "$r" -lt 2 ]; then
      # the peers on the other side of the link, by rank and address
      grep -Eq "lost peers? rank [23] \(10\.77\.0\.2\)" "$log" ||
        fail "rank $r's error does not name a lost peer on 10.77.0.2"
    else
      grep -Eq "lost peer rank 0's host 10\.77\.0\.1" "$log" ||
        fail "rank $r's error does not name the lost host 10.77.0.1"
    fi
    echo "ok: rank $r exited ${RCS[$r]} ${elapsed_ms} ms after the link went down:" \
      "$(grep -o 'Diagnosis: .*' "$log" | head -n 1 | sed 's/\. A peer rank.*//')"
  done
}

case "$MODE" in
  train)
    train_across_the_link --cp-algo=all_gather
    train_across_the_link --cp-algo=hybrid --ulysses-degree 2
    ;;
  link-down) link_down_mid_run ;;
  *) fail "unknown mode '$MODE' (train | link-down)" ;;
esac
