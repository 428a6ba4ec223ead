#!/usr/bin/env bash
# Runs every test. First what needs no server and fails fast: formatting,
# clippy with warnings denied, and the tidy test (the architecture's
# invariants). Then unit and property tests and the integration tests against
# the real local stack (started here if it is not running), and a check that
# the benches still compile.
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

echo "[test] cargo test"
cargo test --locked "$@"

# A reaction is data: the build with a third reaction passes the unit tests
# and carries it through the real pipeline.
echo "[test] a third reaction (--features third-reaction)"
cargo test --locked --features third-reaction --lib --test it -- reactions:: domain:: api::openapi

echo "[test] benches compile"
cargo bench --locked --no-run
