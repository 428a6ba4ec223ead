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
export TALLY_JWT_SECRET=${TALLY_JWT_SECRET:-dev-secret-change-me}
# The development secret is short; tally refuses an HS256 secret under 32
# bytes unless told this is a developer's machine.
export TALLY_INSECURE_DEV_SECRET=${TALLY_INSECURE_DEV_SECRET:-true}
export TALLY_LISTEN=${TALLY_LISTEN:-127.0.0.1:8080}
export TALLY_OPS_LISTEN=${TALLY_OPS_LISTEN:-127.0.0.1:9090}

scripts/stack.sh up
# The dev profile shares its build with scripts/test.sh; set
# TALLY_PROFILE=release for an optimised binary (slower to build).
PROFILE=${TALLY_PROFILE:-dev}
echo "[dev] building tally ($PROFILE profile)"
cargo build --locked --profile "$PROFILE" --bin tally
if [ "$PROFILE" = dev ]; then TALLY="$CARGO_TARGET_DIR/debug/tally"; else TALLY="$CARGO_TARGET_DIR/$PROFILE/tally"; fi

"$TALLY" migrate

mkdir -p .stack/logs
"$TALLY" consumer >>.stack/logs/consumer.log 2>&1 &
CONSUMER=$!
trap 'kill "$CONSUMER" 2>/dev/null; wait "$CONSUMER" 2>/dev/null || true' EXIT

TOKEN=$("$TALLY" token --sub alice --ttl 24h)
cat <<MSG

tally vote listens on http://$TALLY_LISTEN, metrics and readiness on http://$TALLY_OPS_LISTEN   (consumer log: .stack/logs/consumer.log)
Try, with a development token for user "alice":

  curl -s -X POST http://$TALLY_LISTEN/v1/votes \\
    -H "Authorization: Bearer $TOKEN" \\
    -H "Idempotency-Key: \$(cat /proc/sys/kernel/random/uuid)" \\
    -H 'Content-Type: application/json' \\
    -d '{"target_id": "video_abc123", "target_type": "video", "action": "like"}'

  curl -s "http://$TALLY_LISTEN/v1/votes/summary?target_ids=video_abc123" -H "Authorization: Bearer $TOKEN"

MSG
"$TALLY" vote
