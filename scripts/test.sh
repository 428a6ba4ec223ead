#!/usr/bin/env bash
# Runs every test. First what needs no server and fails fast: formatting,
# clippy with warnings denied, and the tidy test (the architecture's
# invariants). Then unit and property tests and the integration tests against
# the real local stack (started here if it is not running), a check that
# the benches still compile, the secure run (TLS and logins to every store,
# `stack.sh up --secure`), and last the cluster run on a three-node
# Cassandra and three Kafka brokers (which replace the single node).
#
#   scripts/test.sh [extra cargo test args]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

# A target directory outside the clone, so a fresh clone (CI) reuses builds.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/tally-target}
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

echo "[test] cargo fmt --check"
cargo fmt --check
# rdkafka builds librdkafka with cmake: the build tools come with the stack's packages.
scripts/stack.sh install
echo "[test] cargo clippy --all-targets -- -D warnings"
cargo clippy --locked --all-targets -- -D warnings
echo "[test] tidy (the invariants in ARCHITECTURE.md)"
cargo test --locked --test tidy
echo "[test] promtool: the alert rules and their unit tests"
promtool check rules docker/prometheus/alerts.yml
promtool test rules docker/prometheus/alerts_test.yml

# A cluster or secure stack left up by an interrupted run holds the single node's ports.
if [ "$(scripts/stack.sh status | head -1)" != "mode: single" ]; then scripts/stack.sh down; fi
scripts/stack.sh up

# Two tests use tools from PyPI: a real OpenAPI 3.1 validator, and
# schemathesis, which fuzzes the running API from its /openapi.json.
if ! python3 -c 'import openapi_spec_validator' 2>/dev/null; then
    echo "[test] installing openapi-spec-validator from PyPI"
    python3 -m pip install --quiet --disable-pip-version-check 'openapi-spec-validator>=0.7,<0.8'
fi
if ! python3 -c 'import schemathesis' 2>/dev/null; then
    echo "[test] installing schemathesis from PyPI"
    python3 -m pip install --quiet --disable-pip-version-check 'schemathesis>=4,<5'
fi

# The browser tests drive Debian's Chromium with playwright-core, pinned in
# clients/js/package-lock.json (npm ci downloads no browser).
lock=$(sha256sum clients/js/package-lock.json | cut -d' ' -f1)
if [ "$(cat clients/js/node_modules/.tally-lock 2>/dev/null)" != "$lock" ]; then
    echo "[test] npm ci (clients/js: playwright-core)"
    npm ci --prefix clients/js --no-audit --no-fund --loglevel=error
    echo "$lock" > clients/js/node_modules/.tally-lock
fi

echo "[test] cargo test"
# Every test but the cluster run, which needs the cluster (below).
# A failed run takes its stack down, as the secure and cluster runs below do.
cargo test --locked --lib --bins --test it --test chaos --test tidy "$@" || { scripts/stack.sh down; exit 1; }
cargo test --locked --doc

# A reaction is data: the build with a third reaction passes the unit tests
# and carries it through the real pipeline.
echo "[test] a third reaction (--features third-reaction)"
cargo test --locked --features third-reaction --lib --test it -- reactions:: domain:: api::openapi || { scripts/stack.sh down; exit 1; }

echo "[test] benches compile"
cargo bench --locked --no-run

# The secure run: the same servers wanting TLS and logins (a throwaway CA,
# Cassandra roles, Kafka SCRAM users with ACLs, a Redis ACL user); tally
# must work with the credentials and stop, naming the store, without them.
echo "[test] the secure run (scripts/stack.sh up --secure)"
scripts/stack.sh down
scripts/stack.sh up --secure
# A failed run takes its stack down too: another clone's stack.sh cannot see
# it, and its servers would hold the ports that clone's stack needs.
cargo test --locked --test secure -- --nocapture || { scripts/stack.sh down; exit 1; }
scripts/stack.sh down

# The cluster run: three Cassandra nodes and three Kafka brokers in place of
# the single node, nodes killed, paused and cut off under load. Set
# TALLY_SKIP_CLUSTER=1 to leave it out of a local run.
if [ "${TALLY_SKIP_CLUSTER:-0}" != 1 ]; then
    echo "[test] the cluster run (scripts/stack.sh up --cluster)"
    scripts/stack.sh up --cluster
    cargo test --locked --test cluster -- --nocapture || { scripts/stack.sh down; exit 1; }
    scripts/stack.sh down
fi
