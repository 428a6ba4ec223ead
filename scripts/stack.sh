#!/usr/bin/env bash
# The local stack: Apache Cassandra 5.0, Apache Kafka 4 (KRaft) and Redis,
# each bound to 127.0.0.1, run from a project-local folder with no Docker.
#
#   scripts/stack.sh install  install what is missing (Debian packages, the Cassandra and Kafka jars)
#   scripts/stack.sh up       install what is missing, start what is not running, wait until each answers
#   scripts/stack.sh down     stop only the processes this script started (by pid)
#   scripts/stack.sh status   say what runs and whether it answers
#   scripts/stack.sh logs     print where the logs are
#   scripts/stack.sh restart cassandra|kafka|redis
#                             stop one server this script started and start it again (fault injection)
#   scripts/stack.sh stop|start cassandra|kafka|redis
#                             stop one server, or start it again (an outage of a chosen length)
#
# Cassandra and Kafka come from Maven Central (scripts/stack/*/pom.xml); Redis
# from Debian's redis-server package. State lives under $TALLY_STACK_DIR
# (default .stack/ in the clone, ignored by git); downloads are cached in ~/.m2.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONF="$ROOT/scripts/stack"
STACK=${TALLY_STACK_DIR:-$ROOT/.stack}
LOGS="$STACK/logs"
RUN="$STACK/run"
CASSANDRA_HEAP=${TALLY_CASSANDRA_HEAP:-1G}
KAFKA_HEAP=${TALLY_KAFKA_HEAP:-512M}
# Seconds to wait for each server to answer after starting it.
START_TIMEOUT=${TALLY_STACK_START_TIMEOUT:-240}

log() { printf '[stack] %s\n' "$*" >&2; }
die() { printf '[stack] error: %s\n' "$*" >&2; exit 1; }

probe() { python3 "$CONF/probe.py" "$@" >/dev/null 2>&1; }

# ---------------------------------------------------------------- installing

apt_updated=0
apt_install() {
    command -v apt-get >/dev/null || die "apt-get not found; install $* by hand"
    if [ "$apt_updated" = 0 ]; then
        log "apt-get update"
        apt-get update -q >"$LOGS/apt.log" 2>&1 || die "apt-get update failed, see $LOGS/apt.log"
        apt_updated=1
    fi
    log "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >>"$LOGS/apt.log" 2>&1 \
        || die "apt-get install $* failed, see $LOGS/apt.log"
}

# The JVM for both Cassandra and Kafka. Cassandra 5.0 runs on Java 11 or 17,
# not newer, so 17 is chosen explicitly rather than whatever `java` is.
find_java17() {
    local candidate
    for candidate in "${TALLY_JAVA_HOME:-}" /usr/lib/jvm/java-17-openjdk-amd64 /usr/lib/jvm/java-17-openjdk-arm64 /usr/lib/jvm/*17*; do
        if [ -n "$candidate" ] && [ -x "$candidate/bin/java" ]; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

ensure_packages() {
    local missing=()
    command -v redis-server >/dev/null || missing+=(redis-server)
    command -v redis-cli >/dev/null || missing+=(redis-tools)
    command -v mvn >/dev/null || missing+=(maven)
    find_java17 >/dev/null || missing+=(openjdk-17-jre-headless)
    # rdkafka builds librdkafka with cmake; its build wants the curl headers
    # even with curl support disabled.
    command -v cmake >/dev/null || missing+=(cmake)
    command -v c++ >/dev/null || missing+=(g++)
    command -v make >/dev/null || missing+=(make)
    [ -e /usr/include/x86_64-linux-gnu/curl/curl.h ] || [ -e /usr/include/curl/curl.h ] \
        || [ -e /usr/include/aarch64-linux-gnu/curl/curl.h ] || missing+=(libcurl4-openssl-dev)
    if [ "${#missing[@]}" -gt 0 ]; then
        apt_install "${missing[@]}"
    fi
    JAVA_HOME=$(find_java17) || die "no Java 17 found after installing openjdk-17-jre-headless"
    export JAVA_HOME
}

# Copies a component's jars from Maven Central (through ~/.m2) once per pom.
fetch_libs() {
    local name=$1 pom="$CONF/$1/pom.xml" dest="$STACK/lib/$1"
    local stamp
    stamp=$(sha256sum "$pom" | cut -d' ' -f1)
    if [ -f "$dest/.stamp" ] && [ "$(cat "$dest/.stamp")" = "$stamp" ]; then
        return 0
    fi
    log "resolving $name from Maven Central (cached in ~/.m2)"
    rm -rf "$dest"
    mkdir -p "$dest"
    JAVA_HOME="$JAVA_HOME" mvn -q -B -f "$pom" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$dest" >"$LOGS/mvn-$name.log" 2>&1 \
        || die "mvn could not resolve $name, see $LOGS/mvn-$name.log"
    echo "$stamp" >"$dest/.stamp"
}

# ---------------------------------------------------------------- processes

pid_of() { [ -f "$RUN/$1.pid" ] && cat "$RUN/$1.pid"; }

# True when the recorded pid is alive and still the process we started (a pid
# can be reused after a reboot; its command line tells).
running() {
    local pid
    pid=$(pid_of "$1") || return 1
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -q "$2" "/proc/$pid/cmdline" 2>/dev/null
}

wait_until() {
    local what=$1 pidname=$2
    shift 2
    local deadline=$((SECONDS + START_TIMEOUT))
    until probe "$@"; do
        if [ -n "$pidname" ] && ! kill -0 "$(pid_of "$pidname")" 2>/dev/null; then
            die "$what exited while starting; see $LOGS/$pidname.out and $LOGS/"
        fi
        [ "$SECONDS" -lt "$deadline" ] || die "$what did not answer within ${START_TIMEOUT}s; see $LOGS/"
        sleep 1
    done
    log "$what answers"
}

# Starts a command detached from this shell, records its pid.
spawn() {
    local name=$1
    shift
    setsid nohup "$@" >"$LOGS/$name.out" 2>&1 </dev/null &
    echo $! >"$RUN/$name.pid"
}

# The servers, one per line: name, the pattern its command line matches
# (to tell our process from a reused pid), the protocol probe.py speaks to
# it, and its port on 127.0.0.1. Every command below walks this table.
SERVERS="
redis     redis-server     redis  6379
kafka     kafka.Kafka      kafka  9092
cassandra CassandraDaemon  cql    9042
"

# Prints the table row of one server, or dies.
server_row() {
    local row
    row=$(echo "$SERVERS" | awk -v n="$1" '$1 == n')
    [ -n "$row" ] || die "no server named $1 (one of: $(echo "$SERVERS" | awk 'NF {print $1}' | xargs))"
    echo "$row"
}

# Starts one server unless it (or a foreign one on its port) already runs,
# then waits until it answers its own protocol.
start() {
    local name pattern kind port
    read -r name pattern kind port <<<"$(server_row "$1")"
    if running "$name" "$pattern"; then
        log "$name already running (pid $(pid_of "$name"))"
    elif probe "$kind" 127.0.0.1 "$port"; then
        log "a $name not started by this script answers on 127.0.0.1:$port; using it"
        return 0
    else
        "launch_$name"
    fi
    wait_until "$name on 127.0.0.1:$port" "$name" "$kind" 127.0.0.1 "$port"
}

launch_cassandra() {
    fetch_libs cassandra
    mkdir -p "$STACK/cassandra/data"
    log "starting cassandra (heap $CASSANDRA_HEAP), log $LOGS/cassandra.log"
    # JVM flags follow Cassandra's own conf/jvm17-server.options.
    spawn cassandra "$JAVA_HOME/bin/java" \
        -Xms"$CASSANDRA_HEAP" -Xmx"$CASSANDRA_HEAP" -Xss256k \
        -XX:+UseG1GC -XX:+ParallelRefProcEnabled -XX:MaxTenuringThreshold=1 \
        -XX:G1RSetUpdatingPauseTimePercent=5 -XX:MaxGCPauseMillis=300 \
        -XX:+ExitOnOutOfMemoryError -XX:+PerfDisableSharedMem -XX:+UseTLAB -XX:+ResizeTLAB \
        -Djava.net.preferIPv4Stack=true -Djdk.attach.allowAttachSelf=true \
        --add-exports java.base/jdk.internal.misc=ALL-UNNAMED \
        --add-exports java.management.rmi/com.sun.jmx.remote.internal.rmi=ALL-UNNAMED \
        --add-exports java.rmi/sun.rmi.registry=ALL-UNNAMED \
        --add-exports java.rmi/sun.rmi.server=ALL-UNNAMED \
        --add-exports java.sql/java.sql=ALL-UNNAMED \
        --add-exports java.base/java.lang.ref=ALL-UNNAMED \
        --add-exports jdk.unsupported/sun.misc=ALL-UNNAMED \
        --add-exports jdk.compiler/com.sun.tools.javac.file=ALL-UNNAMED \
        --add-exports jdk.attach/sun.tools.attach=ALL-UNNAMED \
        --add-opens java.base/java.lang.module=ALL-UNNAMED \
        --add-opens java.base/jdk.internal.loader=ALL-UNNAMED \
        --add-opens java.base/jdk.internal.ref=ALL-UNNAMED \
        --add-opens java.base/jdk.internal.reflect=ALL-UNNAMED \
        --add-opens java.base/jdk.internal.math=ALL-UNNAMED \
        --add-opens java.base/jdk.internal.module=ALL-UNNAMED \
        --add-opens java.base/jdk.internal.util.jar=ALL-UNNAMED \
        --add-opens jdk.management/com.sun.management.internal=ALL-UNNAMED \
        --add-opens java.base/sun.nio.ch=ALL-UNNAMED \
        --add-opens java.base/java.io=ALL-UNNAMED \
        --add-opens java.base/java.lang.reflect=ALL-UNNAMED \
        --add-opens jdk.compiler/com.sun.tools.javac=ALL-UNNAMED \
        --add-opens java.base/java.lang=ALL-UNNAMED \
        --add-opens java.base/java.util=ALL-UNNAMED \
        -Dio.netty.tryReflectionSetAccessible=true \
        -Dio.netty.allocator.useCacheForAllThreads=true -Dio.netty.allocator.maxOrder=11 \
        -Dcassandra.config="file://$CONF/cassandra/cassandra.yaml" \
        -Dcassandra.storagedir="$STACK/cassandra/data" \
        -Dcassandra.logdir="$LOGS" \
        -Dlogback.configurationFile="$CONF/cassandra/logback.xml" \
        -Dcassandra-foreground=yes \
        -Dcassandra.skip_wait_for_gossip_to_settle=0 \
        -Dcassandra.ring_delay_ms=100 \
        -Dcassandra.superuser_setup_delay_ms=0 \
        -cp "$STACK/lib/cassandra/*" org.apache.cassandra.service.CassandraDaemon
}

launch_kafka() {
    fetch_libs kafka
    local data="$STACK/kafka/data" props="$STACK/kafka/server.properties"
    mkdir -p "$data"
    { cat "$CONF/kafka/server.properties"; echo "log.dirs=$data"; } >"$props"
    local java=("$JAVA_HOME/bin/java" -cp "$STACK/lib/kafka/*"
        -Dlog4j2.configurationFile="$CONF/kafka/log4j2.xml" -Dkafka.logs.dir="$LOGS")
    if [ ! -f "$data/meta.properties" ]; then
        local cluster_id
        cluster_id=$("${java[@]}" kafka.tools.StorageTool random-uuid 2>>"$LOGS/kafka-format.log")
        "${java[@]}" kafka.tools.StorageTool format -t "$cluster_id" -c "$props" \
            >>"$LOGS/kafka-format.log" 2>&1 || die "formatting kafka storage failed, see $LOGS/kafka-format.log"
    fi
    log "starting kafka (heap $KAFKA_HEAP), log $LOGS/kafka.log"
    spawn kafka "${java[0]}" -Xms"$KAFKA_HEAP" -Xmx"$KAFKA_HEAP" -XX:+UseG1GC \
        -Djava.awt.headless=true "${java[@]:1}" kafka.Kafka "$props"
}

launch_redis() {
    mkdir -p "$STACK/redis"
    log "starting redis, log $LOGS/redis.log"
    # The cache is rebuilt from Cassandra, so no persistence is wanted.
    spawn redis redis-server --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
        --dir "$STACK/redis" --logfile "$LOGS/redis.log" --daemonize no
}

stop_one() {
    local name=$1 pattern=$2 pid
    if ! running "$name" "$pattern"; then
        rm -f "$RUN/$name.pid"
        return 0
    fi
    pid=$(pid_of "$name")
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 60))
    while kill -0 "$pid" 2>/dev/null; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "$name did not stop within 60s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        sleep 0.5
    done
    rm -f "$RUN/$name.pid"
}

status_one() {
    local name=$1 pattern=$2 kind=$3 port=$4 state answers
    if running "$name" "$pattern"; then state="running (pid $(pid_of "$name"))"; else state="not started by this script"; fi
    if probe "$kind" 127.0.0.1 "$port"; then answers="answers on 127.0.0.1:$port"; else answers="no answer on 127.0.0.1:$port"; fi
    printf '%-10s %-32s %s\n' "$name" "$state" "$answers"
}

each_server() {
    echo "$SERVERS" | awk 'NF {print $1}'
}

main() {
    mkdir -p "$LOGS" "$RUN"
    local name pattern kind port
    case "${1:-}" in
        install)
            ensure_packages
            fetch_libs cassandra
            fetch_libs kafka
            ;;
        up)
            ensure_packages
            for name in $(each_server); do start "$name"; done
            log "stack is up: cassandra 127.0.0.1:9042, kafka 127.0.0.1:9092, redis 127.0.0.1:6379 (logs in $LOGS)"
            ;;
        down)
            for name in $(each_server | tac); do
                read -r name pattern kind port <<<"$(server_row "$name")"
                stop_one "$name" "$pattern"
            done
            ;;
        status)
            for name in $(each_server | tac); do
                read -r name pattern kind port <<<"$(server_row "$name")"
                status_one "$name" "$pattern" "$kind" "$port"
            done
            ;;
        stop)
            [ -n "${2:-}" ] || { echo "usage: $0 stop $(each_server | paste -sd'|')" >&2; exit 2; }
            read -r name pattern kind port <<<"$(server_row "$2")"
            stop_one "$name" "$pattern"
            ;;
        start)
            [ -n "${2:-}" ] || { echo "usage: $0 start $(each_server | paste -sd'|')" >&2; exit 2; }
            ensure_packages
            start "$2"
            ;;
        restart)
            [ -n "${2:-}" ] || { echo "usage: $0 restart $(each_server | paste -sd'|')" >&2; exit 2; }
            read -r name pattern kind port <<<"$(server_row "$2")"
            ensure_packages
            stop_one "$name" "$pattern"
            start "$name"
            ;;
        logs)
            echo "$LOGS"
            ls -1 "$LOGS"
            ;;
        *)
            echo "usage: $0 install|up|down|status|logs|start|stop|restart SERVER" >&2
            exit 2
            ;;
    esac
}

main "$@"
