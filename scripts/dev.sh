#!/usr/bin/env bash
# Brings up the stack, applies the schema, and runs the service: the consumer
# in the background and the vote API in the foreground. Ctrl-C stops both.
#
#   scripts/dev.sh
#
# Settings come from TALLY_* variables (see `tally --help`); the defaults
# below suit a laptop.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/tally-target}
export TALLY_LISTEN=${TALLY_LISTEN:-127.0.0.1:8080}
export TALLY_OPS_LISTEN=${TALLY_OPS_LISTEN:-127.0.0.1:9090}
# The demo page at /demo, with its development login (TALLY_DEMO=false: none).
export TALLY_DEMO=${TALLY_DEMO:-true}

scripts/stack.sh up
# A development secret of this checkout: random, made once, 32 bytes as
# production needs, with an issuer and audience of its own.
mkdir -p .stack
[ -s .stack/dev-jwt-secret ] || openssl rand -hex 32 >.stack/dev-jwt-secret
export TALLY_JWT_SECRET=${TALLY_JWT_SECRET:-$(cat .stack/dev-jwt-secret)}
export TALLY_JWT_ISSUER=${TALLY_JWT_ISSUER:-tally-dev}
export TALLY_JWT_AUDIENCE=${TALLY_JWT_AUDIENCE:-tally-dev}
# The key the vote API signs transitions with and the consumer verifies them
# with, so the consumer needs no read of the rows behind the API's events.
[ -s .stack/dev-event-key ] || openssl rand -hex 32 >.stack/dev-event-key
export TALLY_EVENT_SIGNING_KEY=${TALLY_EVENT_SIGNING_KEY:-$(cat .stack/dev-event-key)}
# An optimised build, so first latencies are the service's own. TALLY_PROFILE=dev
# builds faster (and shares its build with scripts/test.sh).
PROFILE=${TALLY_PROFILE:-release}
echo "[dev] building tally ($PROFILE profile$([ "$PROFILE" = release ] && echo ", optimised"))"
cargo build --locked --profile "$PROFILE" --bin tally
if [ "$PROFILE" = dev ]; then TALLY="$CARGO_TARGET_DIR/debug/tally"; else TALLY="$CARGO_TARGET_DIR/$PROFILE/tally"; fi

"$TALLY" migrate

mkdir -p .stack/logs
"$TALLY" consumer >>.stack/logs/consumer.log 2>&1 &
CONSUMER=$!
trap 'kill "$CONSUMER" 2>/dev/null; wait "$CONSUMER" 2>/dev/null || true' EXIT

TOKEN=$("$TALLY" token --sub alice --ttl 24h)
cat <<MSG

Running ($PROFILE build):
  tally vote      http://$TALLY_LISTEN (the API); metrics and readiness on http://$TALLY_OPS_LISTEN
  tally consumer  in the background, log in .stack/logs/consumer.log
  the stack       cassandra 127.0.0.1:9042, kafka 127.0.0.1:9092, redis 127.0.0.1:6379 (scripts/stack.sh status)
Stop: Ctrl-C stops tally; scripts/stack.sh down stops the stack.
$([ "$TALLY_DEMO" = true ] && printf '\nOpen http://%s/demo for a video and its comments with like buttons (any name signs in).\n' "$TALLY_LISTEN")

Try, with a development token for user "alice":

  curl -s -X POST http://$TALLY_LISTEN/v1/votes \\
    -H "Authorization: Bearer $TOKEN" \\
    -H "Idempotency-Key: \$(cat /proc/sys/kernel/random/uuid)" \\
    -H 'Content-Type: application/json' \\
    -d '{"target_id": "video_abc123", "target_type": "video", "action": "like"}'

  curl -s "http://$TALLY_LISTEN/v1/votes/summary?target_ids=video_abc123" -H "Authorization: Bearer $TOKEN"

MSG
"$TALLY" vote
