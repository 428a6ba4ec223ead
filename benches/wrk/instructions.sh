#!/usr/bin/env bash
# Instructions per request in `tally vote`'s own process, counted by
# valgrind's callgrind: unlike CPU time on a shared 2-core machine (±15-25%
# between runs), the count repeats within about 1% for the same binary and
# load, so it tells apart changes of a few percent. It counts user-space
# instructions only: the kernel's share (sockets, wake-ups) is not in it,
# so read it beside run.sh's CPU per request, not instead of it.
#
#   benches/wrk/instructions.sh BINARY pages|votes [SECS] [CONNECTIONS]
#
# Runs BINARY under callgrind as run.sh runs it (its keyspace, topics and
# prefix, per-user limits out of the way, admission fixed so nothing is
# refused), with BINARY's consumer beside it (not counted), warms it for
# 5 s with instrumentation off, counts SECS (20) of
# wrk at CONNECTIONS (4), then the same SECS idle, and prints
# (loaded - idle) / requests. The stack must be up; the profile stays in
# $TMPDIR/tally-wrk/callgrind.out.* for callgrind_annotate.
set -euo pipefail
BIN=$1; KIND=$2; SECS=${3:-20}; CONNS=${4:-4}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/env.sh"
command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind; }
rm -f "$STATE"/callgrind.out.*
# A consumer keeps the group's lag near zero, as in production: with the
# group behind, `tally vote`'s lag observer reads a message of each lagging
# partition every 5 s, and those reads would land in the loaded and idle
# counts unevenly.
TALLY_CONSUMER_LISTEN=127.0.0.1:19191 "$BIN" consumer 2>"$STATE/consumer.log" &
CONSUMER=$!
# valgrind counts each pass of a `rep movsb` or `rep stosb` as an
# instruction, so glibc's large copies and fills (a task's future moved
# into tokio, actix's header table cleared) would count a byte each where
# the CPU moves 32 or more a cycle. Vector loops are counted as they run.
export GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold=1000000000:glibc.cpu.x86_rep_stosb_threshold=1000000000
TALLY_ADMISSION_TARGET=1h \
valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$STATE/callgrind.out" \
    "$BIN" vote 2>"$STATE/callgrind-vote.log" &
PID=$!
trap 'kill $PID $CONSUMER 2>/dev/null; wait $PID $CONSUMER 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do curl -sf http://127.0.0.1:19090/readyz >/dev/null && break; sleep 0.5; done
count() { callgrind_annotate "$1" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}'; }
wrk -t1 -c"$CONNS" -d5s -s "$HERE/$KIND.lua" http://127.0.0.1:18080 >/dev/null
callgrind_control -i on $PID >/dev/null 2>&1
wrk -t1 -c"$CONNS" -d"${SECS}s" -s "$HERE/$KIND.lua" http://127.0.0.1:18080 >"$STATE/wrk.out"
callgrind_control -d loaded $PID >/dev/null 2>&1
# The same time with no requests: what the process spends anyway (its
# Kafka client, timers, the TTL's lag poll), taken off the loaded count.
sleep "$SECS"
callgrind_control -d idle $PID >/dev/null 2>&1
requests=$(grep -o '[0-9]* requests in' "$STATE/wrk.out" | awk '{print $1}')
loaded=$(count "$(ls "$STATE"/callgrind.out.*1)")
idle=$(count "$(ls "$STATE"/callgrind.out.*2)")
printf '%s %s: %s requests, %s instructions per request (loaded %s, idle %s)\n' \
    "$(basename "$BIN")" "$KIND" "$requests" "$(( (loaded - idle) / requests ))" "$loaded" "$idle"
