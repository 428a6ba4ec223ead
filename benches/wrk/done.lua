-- wrk's end-of-run hook, loaded by votes.lua and pages.lua: one line a
-- program can read (benches/http.rs does), beside wrk's own report.
-- Latencies are of every answer, 503s included, in microseconds.
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "tally-wrk requests=%d non2xx=%d socket_errors=%d micros=%d p50=%d p90=%d p95=%d p99=%d max=%d\n",
    summary.requests, e.status, e.connect + e.read + e.write + e.timeout, summary.duration,
    latency:percentile(50), latency:percentile(90), latency:percentile(95),
    latency:percentile(99), latency.max))
end
