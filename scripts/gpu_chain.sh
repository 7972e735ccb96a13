#!/usr/bin/env bash
# A GPU session as a chain of calls on one warm machine, for a lease of ~15 min of device time.
#
# scripts/gpu_session.sh alone needs the payload (FlashInfer, the real target) to arrive before its
# stages run; over 15 minutes the calls that carry the parts cannot wait for that. Here the first
# call starts a driver in its own session (it outlives the call while the machine stays warm) that
# builds and tests at once; the next calls only bring payload parts (seconds each; issue them back
# to back: the machine goes back after ~30 s idle); the driver picks a bundle up once unpacked; the
# last call waits for the driver until the deadline and returns its outputs.
#
#   call 1:        bash scripts/gpu_chain.sh start SECONDS      carry .gpu-carry/1
#   calls 2..n-1:  bash scripts/gpu_chain.sh collect [SECONDS]  carry .gpu-carry/k
#   call n:        bash scripts/gpu_chain.sh finish [SECONDS]   carry .gpu-carry/n
#
# SECONDS: the driver's deadline from now (a later call may move it, e.g. from the lease time the
# previous reply reported). Driver order: env build | FlashInfer: install fi_warm | real pair:
# e2e | test_engine test_models test_ops | latency bench_ops | (GPU_DRAFT_DATA=1: draft_data) train_draft (GPU_CHAIN_SKIP
# leaves stages out). State and logs: .gpu-state/
# (chain.log, logs/<stage>.log); outputs: .gpu-state/out, copied to $OUT by every call.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export GPU_STATE="${GPU_STATE:-$PWD/.gpu-state}"
STATE="$GPU_STATE"
mkdir -p "$STATE/out"
now() { date +%s; }
POLL_S="${GPU_CHAIN_POLL_S:-3}"   # seconds between looks at the payload and the driver (the tests: less)
set_deadline() { [[ -n "${1:-}" ]] && echo $(($(now) + $1)) > "$STATE/chain_deadline"; true; }
deadline() { cat "$STATE/chain_deadline" 2> /dev/null || echo $(($(now) + 300)); }
copy_out() { [[ -n "${OUT:-}" && -d "${OUT:-}" ]] && cp "$STATE"/out/* "$OUT"/ 2> /dev/null; true; }

# wait_for BUNDLE: until the payload says it is unpacked, the last call has come, or the deadline.
wait_for() {
  if [[ -f "$STATE/payload/MANIFEST" ]] && ! grep -q "^$1 " "$STATE/payload/MANIFEST"; then
    echo "[chain] $1: not in this payload (GPU_BUNDLES)"; return 1
  fi
  until grep -q "$1 unpacked" "$STATE/payload/status" 2> /dev/null; do
    [[ -f "$STATE/payload_final" ]] && { echo "[chain] $1: the last call came without it"; return 1; }
    (($(now) < $(deadline) - 60)) || { echo "[chain] $1: not complete before the deadline"; return 1; }
    sleep "$POLL_S"
  done
}

# GPU_CHAIN_SKIP: stages the driver leaves out (e.g. "test_ops bench_ops latency" when the kernels
# have not changed since the last run and the lease is wanted for train_draft).
session() {
  local keep=() s
  for s in "$@"; do [[ " ${GPU_CHAIN_SKIP:-} " == *" $s "* ]] || keep+=("$s"); done
  ((${#keep[@]})) || return 0
  GPU_DEADLINE="$(deadline)" GPU_NO_COLLECT=1 OUT="$STATE/out" bash scripts/gpu_session.sh "${keep[@]}"
}

case "${1:-}" in
  start)
    rm -f "$STATE/payload_final"
    set_deadline "${2:-540}"
    GPU_PAYLOAD_ONLY=1 bash scripts/gpu_session.sh
    setsid nohup bash scripts/gpu_chain.sh drive > "$STATE/chain.log" 2>&1 < /dev/null &
    echo $! > "$STATE/chain.pid"
    sleep "${GPU_CHAIN_START_S:-5}"   # the driver's first lines, for this call's reply
    cat "$STATE/chain.log"
    ;;
  collect)
    set_deadline "${2:-}"
    GPU_PAYLOAD_ONLY=1 bash scripts/gpu_session.sh
    tail -n 4 "$STATE/chain.log"
    copy_out
    ;;
  finish)
    set_deadline "${2:-}"
    GPU_PAYLOAD_ONLY=1 bash scripts/gpu_session.sh
    touch "$STATE/payload_final"
    while kill -0 "$(cat "$STATE/chain.pid")" 2> /dev/null && (($(now) < $(deadline) + 20)); do sleep "$POLL_S"; done
    kill -0 "$(cat "$STATE/chain.pid")" 2> /dev/null && echo "[chain] driver still running at the deadline"
    cat "$STATE/chain.log"
    cp "$STATE/chain.log" "$STATE/out/" 2> /dev/null
    copy_out
    ;;
  drive)
    # The end-to-end figures first (the payload is whole about a minute after the first call,
    # while the build runs), then correctness, then the microbenchmarks.
    session env build
    wait_for fi && session install fi_warm
    GPU_E2E_N="${GPU_E2E_N:-4}"; export GPU_E2E_N
    wait_for e2e && session e2e
    session test_engine test_models test_ops
    session latency bench_ops
    [[ "${GPU_DRAFT_DATA:-0}" == 1 ]] && session draft_data
    session train_draft
    echo "[chain] driver done at +$(($(now) - $(stat -c %Y "$STATE/chain.pid")))s"
    ;;
  *)
    sed -n '2,20p' "$0"
    exit 2
    ;;
esac
