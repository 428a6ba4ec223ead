#!/usr/bin/env bash
# Installs an HTTP load generator the benches drive the API with, and prints
# its path:
# - vegeta (github.com/tsenart/vegeta), an open-loop generator (a fixed
#   arrival rate, whatever the server does) that also runs closed loop with a
#   fixed number of workers. Built once with Go from the module proxy into
#   ~/.cache/tally-tools; Go itself comes from the machine (/usr/local/go) or
#   Debian's golang-go.
# - wrk, Debian's: closed loop only, in C, the lightest generator on shared
#   cores.
# - oha (crates.io), an open-loop generator in Rust that measures each
#   latency from when its request was due (coordinated omission corrected),
#   at 24 to 45 µs of CPU a page against vegeta's 76 to 121 (BENCHMARKS.md,
#   section 28): the one that can offer 8,000 pages a second beside the
#   stack on 2 cores. Built once with cargo (about five minutes) into
#   ~/.cache/tally-tools.
#
#   scripts/bench-tools.sh vegeta|wrk|oha   # prints the binary's path
set -euo pipefail
VEGETA_VERSION=v12.13.0
OHA_VERSION=1.16.0
TOOLS=${TALLY_TOOLS:-$HOME/.cache/tally-tools}

go_binary() {
    if command -v go >/dev/null; then command -v go
    elif [ -x /usr/local/go/bin/go ]; then echo /usr/local/go/bin/go
    else
        echo "[tools] installing Go from Debian" >&2
        apt-get update -qq >&2 && apt-get install -y -qq golang-go >&2
        command -v go
    fi
}

case "${1:-}" in
    vegeta)
        bin="$TOOLS/vegeta-$VEGETA_VERSION/vegeta"
        if [ ! -x "$bin" ]; then
            echo "[tools] building vegeta $VEGETA_VERSION (about a minute)" >&2
            GOBIN="$TOOLS/vegeta-$VEGETA_VERSION" GOFLAGS=-buildvcs=false \
                "$(go_binary)" install "github.com/tsenart/vegeta/v12@$VEGETA_VERSION" >&2
        fi
        echo "$bin"
        ;;
    wrk)
        if ! command -v wrk >/dev/null; then
            echo "[tools] installing wrk from Debian" >&2
            apt-get update -qq >&2 && apt-get install -y -qq wrk >&2
        fi
        command -v wrk
        ;;
    oha)
        bin="$TOOLS/oha-$OHA_VERSION/bin/oha"
        if [ ! -x "$bin" ]; then
            echo "[tools] building oha $OHA_VERSION (about five minutes)" >&2
            cargo install --quiet --locked oha --version "$OHA_VERSION" --root "$TOOLS/oha-$OHA_VERSION" >&2
        fi
        echo "$bin"
        ;;
    *)
        echo "usage: scripts/bench-tools.sh vegeta|wrk|oha" >&2
        exit 2
        ;;
esac
