# Sourced by run.sh and instructions.sh, with BIN set: the setting both run
# `tally vote` in. Its own keyspace, topics, Redis prefix and group
# (wrkbench), on 127.0.0.1:18080 (operator endpoints :19090), per-user
# limits out of the way (the load is 500 users), 500 tokens made once.
STATE=${TMPDIR:-/tmp}/tally-wrk; mkdir -p "$STATE"
"$HERE/../../scripts/bench-tools.sh" wrk >/dev/null
export TALLY_KEYSPACE=wrkbench TALLY_TOPIC=wrkbench-tx TALLY_DEAD_LETTER_TOPIC=wrkbench-dlq TALLY_REDIS_PREFIX=wrkbench
export TALLY_CONSUMER_GROUP=wrkbench TALLY_LISTEN=127.0.0.1:18080 TALLY_OPS_LISTEN=127.0.0.1:19090
export TALLY_JWT_SECRET=wrk-bench-secret-of-32-bytes-or-more TALLY_JWT_ISSUER=tally-wrk TALLY_JWT_AUDIENCE=tally-wrk
export TALLY_USER_RATE=100000 TALLY_USER_BURST=100000 TALLY_USER_READ_RATE=100000 TALLY_USER_READ_BURST=100000
export TALLY_USER_NEW_TARGETS_RATE=100000 TALLY_USER_NEW_TARGETS_BURST=100000 TALLY_USER_DAILY_VOTES=1000000000
export RUST_LOG=warn TALLY_LOG_FORMAT=json WRK_TOKENS=$STATE/tokens.txt
"$BIN" migrate >/dev/null
[ -s "$WRK_TOKENS" ] || for i in $(seq 1 500); do "$BIN" token --sub "u$i" --ttl 24h; done >"$WRK_TOKENS"
