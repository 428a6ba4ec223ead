#!/usr/bin/env bash
# A closed loop of wrk (Debian's) against `tally vote`, with the server's own
# CPU per request from /proc: the lightest generator to set beside vegeta's
# figures (benches/http.rs), and a way to put two builds side by side.
#
#   benches/wrk/run.sh BINARY pages|cold|votes [SECS] [CONNECTIONS]
#
# Runs BINARY as `tally vote` on 127.0.0.1:18080 over its own keyspace,
# topics and Redis prefix (wrkbench), with per-user limits out of the way,
# warms it up for 3 s, then measures. The stack must be up.
#
# TALLY_WRK_PIN=1 splits the machine as `TALLY_HTTP_PIN=1` does for the http
# bench: the stack's servers and tally on CPU 0, wrk on CPU 1, put back when
# the script ends. Without it a storm of connections takes its CPU from the
# service it measures. Any other TALLY_* setting in the environment (say
# TALLY_ADMISSION_REFUSAL_RATIO=0) reaches `tally vote`.
#
# TALLY_WRK_CONSUMER=1 runs `tally consumer` (the same BINARY) beside it, adds
# its CPU and Kafka's per request, and after the loop prints the lag it left
# and how long it took to count it (at most 120 s). TALLY_WRK_WARM=1 reads
# every target's count once before the warm-up, as the pages voters come from
# would, so that votes do not pay the cache's first fill. With
# TALLY_EVENT_SIGNING_KEY set, both sign and verify transitions with it.
#
# TALLY_WRK_RATE=R (pages only) drives the loop open instead, from
# oha (scripts/bench-tools.sh oha): R requests a second whatever the server
# does, over CONNECTIONS connections, each latency counted from when its
# request was due (coordinated omission corrected), so the p99 is the one a
# page sees at that rate, not at the most a closed loop can push. oha sends
# one Authorization header, so every page is the first token's user, and
# draws each page at random from the 200 that pages.lua asks for.
# Its own CPU per request is printed, from its rusage. TALLY_WRK_OHA_DB=FILE
# has oha record every request in that SQLite file (when it was due, sent
# and answered): when in the run the slow ones came.
#
# TALLY_WRK_THREADS=1 prints where Cassandra's CPU went over the loop, by
# kind of thread (request stages, compaction, flushing, GC, the JIT...), per
# request (threads.py): whether a store's cost is its requests' or its
# background work's.
set -euo pipefail
BIN=$1; KIND=$2; SECS=${3:-10}; CONNS=${4:-32}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/env.sh"
RATE=${TALLY_WRK_RATE:-}
if [ -n "$RATE" ]; then
    # oha sends one body and one set of headers, and draws pages from a list
    # made up front: new votes' keys and cold ids can't be drawn afresh.
    [ "$KIND" = pages ] || { echo "TALLY_WRK_RATE drives pages, not $KIND" >&2; exit 2; }
    OHA=$("$HERE/../../scripts/bench-tools.sh" oha)
    # Every page pages.lua asks for: a video and its 20 comments.
    python3 - >"$STATE/urls.txt" <<'PY'
for v in range(200):
    ids = ["t%d" % v] + ["c%d_%d" % (v, k) for k in range(20)]
    print("http://127.0.0.1:18080/v1/votes/summary?target_ids=" + ",".join(ids))
PY
fi
SERVER=(); CLIENT=()
if [ "${TALLY_WRK_PIN:-}" = 1 ]; then
    SERVER=(taskset -c 0); CLIENT=(taskset -c 1)
    STACK_PIDS=$(cat "$HERE"/../../.stack/run/*.pid 2>/dev/null || true)
    for p in $STACK_PIDS; do taskset -a -pc 0 "$p" >/dev/null; done
fi
unpin() { for p in ${STACK_PIDS:-}; do taskset -a -pc "0-$(( $(nproc) - 1 ))" "$p" >/dev/null 2>&1 || true; done; }
"${SERVER[@]}" "$BIN" vote 2>"$STATE/vote.log" &
PID=$!
CONSUMER=
if [ "${TALLY_WRK_CONSUMER:-}" = 1 ]; then
    TALLY_CONSUMER_LISTEN=127.0.0.1:19091 "${SERVER[@]}" "$BIN" consumer 2>"$STATE/consumer.log" &
    CONSUMER=$!
fi
trap 'kill $PID $CONSUMER 2>/dev/null; wait $PID $CONSUMER 2>/dev/null || true; unpin' EXIT
for _ in $(seq 1 150); do curl -sf http://127.0.0.1:19090/readyz >/dev/null && break; sleep 0.2; done
if [ "${TALLY_WRK_WARM:-}" = 1 ]; then
    token=$(head -1 "$WRK_TOKENS")
    for page in $(seq 0 199); do
        ids=$(seq $((page * 50)) $((page * 50 + 49)) | sed 's/^/t/' | paste -sd,)
        curl -sf -o /dev/null -H "Authorization: Bearer $token" "http://127.0.0.1:18080/v1/votes/summary?target_ids=$ids"
    done
fi
"${CLIENT[@]}" wrk -t1 -c"$CONNS" -d3s -s "$HERE/$KIND.lua" http://127.0.0.1:18080 >/dev/null
cpu() { awk '{print $14 + $15}' "/proc/${1:-$PID}/stat"; }
# Cassandra's CPU too: on one machine the store's cost per request is what
# bounds the vote, more than tally's own.
CASSANDRA=$(cat "$HERE/../../.stack/run/cassandra.pid" 2>/dev/null || echo $$)
# And Redis's: a page's lookups run there.
REDIS=$(cat "$HERE/../../.stack/run/redis.pid" 2>/dev/null || echo $$)
# And the machine's busy time (user, nice, system, irq, softirq), which on
# shared cores is what bounds a rate.
busy() { awk '$1 == "cpu" {print $2 + $3 + $4 + $7 + $8}' /proc/stat; }
# And, with the consumer, its own and Kafka's: a transition is produced by
# the vote, fetched by the consumer, and both cost the broker.
KAFKA=$(cat "$HERE/../../.stack/run/kafka.pid" 2>/dev/null || echo $$)
COUNTER=${CONSUMER:-$$}
lag() { curl -sf http://127.0.0.1:19091/metrics | awk '/^tally_consumer_lag_messages/ {s += $NF} END {print s + 0}'; }
# Polls until the consumer is behind by nothing, for at most 120 s.
until_counted() { for _ in $(seq 1 240); do [ "$(lag)" = 0 ] && break; sleep 0.5; done; }
if [ -n "$CONSUMER" ]; then
    # The warm-up's votes counted first, so the loop starts with none behind.
    until_counted
fi
# Cassandra's threads, only where the stack's pid file named it; a failed
# snapshot costs the breakdown, never the run's figures.
THREADS=
[ "${TALLY_WRK_THREADS:-}" = 1 ] && [ "$CASSANDRA" != $$ ] && THREADS=1
[ -n "$THREADS" ] && { python3 "$HERE/threads.py" snapshot "$CASSANDRA" >"$STATE/threads.before" || THREADS=; }
# Time each process's threads spent runnable but waiting for a core
# (/proc/PID/task/*/schedstat, ns): on shared cores, where a request's
# latency goes beyond its CPU. A thread that ends during the loop takes its
# share with it, so this undercounts a process that retires threads.
waited() { { cat /proc/"$1"/task/*/schedstat 2>/dev/null || true; } | awk '{s += $2} END {printf "%.0f", s / 1000}'; }
w0=$(waited $PID); wc0=$(waited "$CASSANDRA"); wr0=$(waited "$REDIS")
t0=$(cpu); c0=$(cpu "$CASSANDRA"); r0=$(cpu "$REDIS"); m0=$(busy); k0=$(cpu "$KAFKA"); n0=$(cpu "$COUNTER")
if [ -n "$RATE" ]; then
    # The generator's own CPU from its rusage, as it ends.
    "${CLIENT[@]}" python3 -c 'import resource, subprocess, sys
subprocess.run(sys.argv[2:], check=True)
r = resource.getrusage(resource.RUSAGE_CHILDREN)
open(sys.argv[1], "w").write("%f\n" % (r.ru_utime + r.ru_stime))' "$STATE/oha.cpu" \
        "$OHA" --no-tui --output-format json -q "$RATE" --latency-correction -z "${SECS}s" -c "$CONNS" \
        -H "Authorization: Bearer $(head -1 "$WRK_TOKENS")" ${TALLY_WRK_OHA_DB:+--db-url "$TALLY_WRK_OHA_DB"} --urls-from-file "$STATE/urls.txt" >"$STATE/oha.json"
else
    "${CLIENT[@]}" wrk -t1 -c"$CONNS" -d"${SECS}s" --latency -s "$HERE/$KIND.lua" http://127.0.0.1:18080 >"$STATE/wrk.out"
fi
w1=$(waited $PID); wc1=$(waited "$CASSANDRA"); wr1=$(waited "$REDIS")
t1=$(cpu); c1=$(cpu "$CASSANDRA"); r1=$(cpu "$REDIS"); m1=$(busy); k1=$(cpu "$KAFKA"); n1=$(cpu "$COUNTER")
[ -n "$THREADS" ] && { python3 "$HERE/threads.py" snapshot "$CASSANDRA" >"$STATE/threads.after" || THREADS=; }
if [ -n "$RATE" ]; then
    # requests, non-2xx, req/s, goodput/s, p50, p99 from oha's report, every
    # answer's latency included as wrk's are; requests cut off by the end of
    # the run are neither answers nor counted.
    read -r requests refused reqs goodput p50 p99 < <(python3 - "$STATE/oha.json" "$SECS" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
codes = {int(k): v for k, v in r["statusCodeDistribution"].items()}
answered = sum(codes.values())
ok = sum(v for k, v in codes.items() if 200 <= k < 300)
secs = float(sys.argv[2])
lat = r["latencyPercentiles"]
print(answered, answered - ok, "%.2f" % (answered / secs), "%.0f" % (ok / secs),
      "%.2fms" % (lat["p50"] * 1e3), "%.2fms" % (lat["p99"] * 1e3))
PY
)
else
    requests=$(grep -o '[0-9]* requests in' "$STATE/wrk.out" | awk '{print $1}')
    refused=$(grep -o 'Non-2xx or 3xx responses: [0-9]*' "$STATE/wrk.out" | awk '{print $NF}' || true)
    reqs=$(awk '/Requests\/sec/ {print $2}' "$STATE/wrk.out")
    # Goodput: the answers that were not refusals (or any other non-2xx), a second.
    goodput=$(awk -v r="$requests" -v n="${refused:-0}" '/ requests in / {d = $4; if (d ~ /m,$/) {sub("m,", "", d); d *= 60} else sub("s,", "", d); printf "%.0f", (r - n) / d}' "$STATE/wrk.out")
    p50=$(awk '$1 == "50%" {print $2}' "$STATE/wrk.out"); p99=$(awk '$1 == "99%" {print $2}' "$STATE/wrk.out")
fi
ticks=$(getconf CLK_TCK)
printf '%s %s: %s req/s, goodput %s/s, p50 %s, p99 %s, non-2xx %s, tally CPU per request %s us, cassandra %s us, redis %s us, machine %s us\n' \
    "$(basename "$BIN")" "$KIND" "$reqs" "$goodput" "$p50" "$p99" \
    "${refused:-0}" "$(( (t1 - t0) * 1000000 / ticks / requests ))" "$(( (c1 - c0) * 1000000 / ticks / requests ))" \
    "$(( (r1 - r0) * 1000000 / ticks / requests ))" "$(( (m1 - m0) * 1000000 / ticks / requests ))"
printf 'waiting for a core per request: tally %s us, cassandra %s us, redis %s us\n' \
    "$(( (w1 - w0) / requests ))" "$(( (wc1 - wc0) / requests ))" "$(( (wr1 - wr0) / requests ))"
if [ -n "$RATE" ]; then
    printf 'offered %s/s open loop; oha CPU per request %s us\n' "$RATE" \
        "$(awk -v n="$requests" '{printf "%.0f", $1 * 1e6 / n}' "$STATE/oha.cpu")"
fi
if [ -n "$CONSUMER" ]; then
    printf 'consumer CPU per request %s us, kafka %s us; ' \
        "$(( (n1 - n0) * 1000000 / ticks / requests ))" "$(( (k1 - k0) * 1000000 / ticks / requests ))"
    left=$(lag); start=$(date +%s%N)
    until_counted
    printf 'the consumer was %s transitions behind at the end and counted them in %s ms (lag now %s)\n' \
        "$left" "$(( ($(date +%s%N) - start) / 1000000 ))" "$(lag)"
    # How it checked the events (with TALLY_EVENT_SIGNING_KEY set, the signed
    # ones were not read against the rows).
    curl -sf http://127.0.0.1:19091/metrics | grep -E '^tally_consumer_event_checks_total' || true
fi
if [ -n "$THREADS" ]; then
    echo "Cassandra's CPU by kind of thread:"
    python3 "$HERE/threads.py" diff "$STATE/threads.before" "$STATE/threads.after" "$requests" || true
fi
# What the API saw: its cache's lookups and fills, its Paxos outcomes and its admission, to explain a figure.
curl -sf http://127.0.0.1:19090/metrics | grep -E '^tally_(cache_fills_total|cache_lookups_total|cas_total|admission_limit|admission_refused_total|admission_refusals_paced_total)' || true
