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
#   scripts/stack.sh pid SERVER
#                             print the pid of one server this script started (for kill -9, SIGSTOP)
#
#   scripts/stack.sh up --cluster
#                             three Cassandra nodes (RF=3 keyspaces, dc1) and three KRaft brokers on
#                             127.0.0.1, 127.0.0.2 and 127.0.0.3, same ports on each address, and one
#                             Redis; the servers are named cassandra1..3 and kafka1..3. Once up, the
#                             other commands act on the cluster until `down`. Linux routes all of
#                             127.0.0.0/8 to the loopback interface, so no setup is needed.
#   scripts/stack.sh up --secure
#                             the single node's three servers wanting TLS and a login (a throwaway CA
#                             from openssl, Cassandra roles, Kafka SASL/SCRAM users and ACLs, a Redis
#                             ACL user); each role's TALLY_* variables land in .stack/secure/*.env.
#                             See scripts/stack/secure.sh.
#   scripts/stack.sh nodetool ARGS
#                             Cassandra's nodetool against the (first) node's local-only JMX port,
#                             e.g. `nodetool flush KEYSPACE target_stats` or `nodetool tablestats`
#   scripts/stack.sh sstablepartitions ARGS
#                             Cassandra's sstablepartitions: the largest partitions of SSTables, in
#                             rows and bytes, read from the files themselves
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
# 2 GB, not 1: after hours of benches, compacting a large system.paxos (the
# default purging keeps Paxos state for the tables' gc_grace) beside a vote
# load ran a 1 GB heap out of memory, and the node then died again on every
# start while it compacted the same tables.
CASSANDRA_HEAP=${TALLY_CASSANDRA_HEAP:-2G}
KAFKA_HEAP=${TALLY_KAFKA_HEAP:-512M}
# Three of each share 2 cores and the memory: smaller heaps per node.
CLUSTER_CASSANDRA_HEAP=${TALLY_CLUSTER_CASSANDRA_HEAP:-512M}
CLUSTER_KAFKA_HEAP=${TALLY_CLUSTER_KAFKA_HEAP:-384M}
# Which stack `up` last started: single or cluster.
MODE_FILE="$RUN/mode"
# Seconds to wait for each server to answer after starting it.
START_TIMEOUT=${TALLY_STACK_START_TIMEOUT:-240}

log() { printf '[stack] %s\n' "$*" >&2; }
die() { printf '[stack] error: %s\n' "$*" >&2; exit 1; }

probe() { PROBE_CA="$STACK/secure/ca.pem" python3 "$CONF/probe.py" "$@" >/dev/null 2>&1; }

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
    # The cluster run cuts loopback links between nodes with iptables.
    command -v iptables >/dev/null || missing+=(iptables)
    [ -e /usr/include/x86_64-linux-gnu/curl/curl.h ] || [ -e /usr/include/curl/curl.h ] \
        || [ -e /usr/include/aarch64-linux-gnu/curl/curl.h ] || missing+=(libcurl4-openssl-dev)
    # TLS: librdkafka and the Cassandra driver link the system OpenSSL; the
    # secure stack makes its certificates with the openssl tool.
    [ -e /usr/include/openssl/ssl.h ] || missing+=(libssl-dev)
    command -v pkg-config >/dev/null || missing+=(pkg-config)
    command -v openssl >/dev/null || missing+=(openssl)
    # promtool checks and unit-tests the alert rules (scripts/test.sh).
    command -v promtool >/dev/null || missing+=(prometheus)
    # The JavaScript reference client's tests (clients/js) run on Node.
    command -v node >/dev/null || missing+=(nodejs)
    command -v npm >/dev/null || missing+=(npm)
    # The demo page's browser tests run in Debian's headless Chromium
    # (driven over the DevTools protocol; no browser is downloaded).
    command -v chromium >/dev/null || missing+=(chromium)
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
# it, its address and port. Every command below walks one of these tables.
SINGLE_SERVERS="
redis      redis-server     redis  127.0.0.1  6379
kafka      kafka.Kafka      kafka  127.0.0.1  9092
cassandra  CassandraDaemon  cql    127.0.0.1  9042
"
CLUSTER_SERVERS="
redis      redis-server     redis  127.0.0.1  6379
kafka1     kafka.Kafka      kafka  127.0.0.1  9092
kafka2     kafka.Kafka      kafka  127.0.0.2  9092
kafka3     kafka.Kafka      kafka  127.0.0.3  9092
cassandra1 CassandraDaemon  cql    127.0.0.1  9042
cassandra2 CassandraDaemon  cql    127.0.0.2  9042
cassandra3 CassandraDaemon  cql    127.0.0.3  9042
"
SECURE_SERVERS="
redis      redis-server     redis-tls  127.0.0.1  6379
kafka      kafka.Kafka      kafka-tls  127.0.0.1  9092
cassandra  CassandraDaemon  cql-tls    127.0.0.1  9042
"
SERVERS=$SINGLE_SERVERS
SERVERS_MODE=single
# Extra arguments of the next Kafka storage format (SCRAM users).
FORMAT_EXTRA=()
# shellcheck source=stack/secure.sh
. "$CONF/secure.sh"

mode() { if [ -f "$MODE_FILE" ]; then cat "$MODE_FILE"; else echo single; fi; }
use_mode() {
    case "$1" in
        single) SERVERS=$SINGLE_SERVERS ;;
        cluster) SERVERS=$CLUSTER_SERVERS ;;
        secure) SERVERS=$SECURE_SERVERS ;;
        *) die "unknown stack mode $1" ;;
    esac
    SERVERS_MODE=$1
}

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
    launch_unless_running "$1" || return 0
    await "$1"
}

# Launches one server unless it (or a foreign one on its port) already runs;
# returns 1 when a foreign one answers (nothing of ours to wait for).
launch_unless_running() {
    local name pattern kind host port
    read -r name pattern kind host port <<<"$(server_row "$1")"
    if running "$name" "$pattern"; then
        log "$name already running (pid $(pid_of "$name"))"
    elif probe "$kind" "$host" "$port"; then
        log "a $name not started by this script answers on $host:$port; using it"
        return 1
    else
        case "$SERVERS_MODE:$name" in
            secure:*) "launch_secure_$name" ;;
            *:cassandra[1-3]) launch_cassandra_node "$name" "$host" "${name#cassandra}" ;;
            *:kafka[1-3]) launch_kafka_node "$name" "$host" "${name#kafka}" ;;
            *) "launch_$name" ;;
        esac
    fi
}

await() {
    local name pattern kind host port
    read -r name pattern kind host port <<<"$(server_row "$1")"
    wait_until "$name on $host:$port" "$name" "$kind" "$host" "$port"
}

# The module flags Cassandra 5 needs on Java 17, from its conf/jvm17-server.options
# and jvm17-clients.options: for the nodes and for its tools.
JVM17_MODULES=(
    --add-exports java.base/jdk.internal.misc=ALL-UNNAMED
    --add-exports java.management.rmi/com.sun.jmx.remote.internal.rmi=ALL-UNNAMED
    --add-exports java.rmi/sun.rmi.registry=ALL-UNNAMED
    --add-exports java.rmi/sun.rmi.server=ALL-UNNAMED
    --add-exports java.sql/java.sql=ALL-UNNAMED
    --add-exports java.base/java.lang.ref=ALL-UNNAMED
    --add-exports jdk.unsupported/sun.misc=ALL-UNNAMED
    --add-exports jdk.compiler/com.sun.tools.javac.file=ALL-UNNAMED
    --add-exports jdk.attach/sun.tools.attach=ALL-UNNAMED
    --add-opens java.base/java.lang.module=ALL-UNNAMED
    --add-opens java.base/jdk.internal.loader=ALL-UNNAMED
    --add-opens java.base/jdk.internal.ref=ALL-UNNAMED
    --add-opens java.base/jdk.internal.reflect=ALL-UNNAMED
    --add-opens java.base/jdk.internal.math=ALL-UNNAMED
    --add-opens java.base/jdk.internal.module=ALL-UNNAMED
    --add-opens java.base/jdk.internal.util.jar=ALL-UNNAMED
    --add-opens jdk.management/com.sun.management.internal=ALL-UNNAMED
    --add-opens java.base/sun.nio.ch=ALL-UNNAMED
    --add-opens java.base/java.io=ALL-UNNAMED
    --add-opens java.base/java.lang.reflect=ALL-UNNAMED
    --add-opens jdk.compiler/com.sun.tools.javac=ALL-UNNAMED
    --add-opens java.base/java.lang=ALL-UNNAMED
    --add-opens java.base/java.util=ALL-UNNAMED
    --add-exports java.base/jdk.internal.ref=ALL-UNNAMED
    --add-exports java.base/sun.nio.ch=ALL-UNNAMED
    --add-opens java.base/java.net=ALL-UNNAMED
    --add-opens java.base/java.nio=ALL-UNNAMED
)

# The JVM command of one Cassandra node: $1 its name, $2 its heap, $3 its
# cassandra.yaml, $4 a folder put first on the class path (rack and DC
# properties), then any extra -D flags. Flags follow Cassandra's own
# conf/jvm17-server.options.
cassandra_jvm() {
    local name=$1 heap=$2 yaml=$3 conf=$4
    shift 4
    spawn "$name" "$JAVA_HOME/bin/java" \
        -Xms"$heap" -Xmx"$heap" -Xss256k \
        -XX:+UseG1GC -XX:+ParallelRefProcEnabled -XX:MaxTenuringThreshold=1 \
        -XX:G1RSetUpdatingPauseTimePercent=5 -XX:MaxGCPauseMillis=300 \
        -XX:+ExitOnOutOfMemoryError -XX:+PerfDisableSharedMem -XX:+UseTLAB -XX:+ResizeTLAB \
        -Djava.net.preferIPv4Stack=true -Djdk.attach.allowAttachSelf=true \
        "${JVM17_MODULES[@]}" \
        -Dio.netty.tryReflectionSetAccessible=true \
        -Dio.netty.allocator.useCacheForAllThreads=true -Dio.netty.allocator.maxOrder=11 \
        -Dcassandra.config="file://$yaml" \
        -Dcassandra.storagedir="${NODE_DATA:-$STACK/$name/data}" \
        -Dcassandra.logdir="$LOGS/$name" \
        -Dlogback.configurationFile="$CONF/cassandra/logback.xml" \
        -Dcassandra-foreground=yes \
        -Dcassandra.skip_wait_for_gossip_to_settle=0 \
        -Dcassandra.ring_delay_ms=100 \
        -Dcassandra.superuser_setup_delay_ms=0 \
        "$@" \
        -cp "$conf:$STACK/lib/cassandra/*" org.apache.cassandra.service.CassandraDaemon
}

launch_cassandra() {
    fetch_libs cassandra
    mkdir -p "$STACK/cassandra/data" "$LOGS/cassandra" "$STACK/cassandra/conf"
    log "starting cassandra (heap $CASSANDRA_HEAP), log $LOGS/cassandra/cassandra.log"
    cassandra_jvm cassandra "$CASSANDRA_HEAP" "$CONF/cassandra/cassandra.yaml" "$STACK/cassandra/conf" \
        -Dcassandra.jmx.local.port=7199
}

# Node $3 (1-3) of the cluster on address $2: its own yaml (address, token,
# the three seeds, a snitch that reads its DC), its own data, logs and JMX
# port. Tokens split the ring evenly, so the nodes can start together.
launch_cassandra_node() {
    local name=$1 host=$2 n=$3 dir="$STACK/$1"
    local tokens=(-9223372036854775808 -3074457345618258603 3074457345618258602)
    fetch_libs cassandra
    mkdir -p "$dir/data" "$dir/conf" "$LOGS/$name"
    sed -e "s/^listen_address: .*/listen_address: $host/" \
        -e "s/^rpc_address: .*/rpc_address: $host/" \
        -e "s/^initial_token: .*/initial_token: ${tokens[$((n - 1))]}/" \
        -e 's/- seeds: .*/- seeds: "127.0.0.1:7000,127.0.0.2:7000,127.0.0.3:7000"/' \
        -e "s/^endpoint_snitch: .*/endpoint_snitch: GossipingPropertyFileSnitch/" \
        "$CONF/cassandra/cassandra.yaml" >"$dir/cassandra.yaml"
    printf 'dc=dc1\nrack=rack%s\n' "$n" >"$dir/conf/cassandra-rackdc.properties"
    log "starting $name on $host (heap $CLUSTER_CASSANDRA_HEAP), log $LOGS/$name/cassandra.log"
    cassandra_jvm "$name" "$CLUSTER_CASSANDRA_HEAP" "$dir/cassandra.yaml" "$dir/conf" \
        -Dcassandra.jmx.local.port=$((7199 + n))
}

# Formats a broker's storage once, then starts it: $1 name, $2 properties
# (log.dirs appended here), $3 heap, $4 the cluster id to format with.
kafka_jvm() {
    local name=$1 base=$2 heap=$3 cluster_id=$4
    local dir=${NODE_DIR:-$STACK/$name}
    local data="$dir/data" props="$dir/server.properties"
    mkdir -p "$data" "$LOGS/$name"
    { cat "$base"; echo "log.dirs=$data"; } >"$props"
    local java=("$JAVA_HOME/bin/java" -cp "$STACK/lib/kafka/*"
        -Dlog4j2.configurationFile="$CONF/kafka/log4j2.xml" -Dkafka.logs.dir="$LOGS/$name")
    if [ ! -f "$data/meta.properties" ]; then
        "${java[@]}" kafka.tools.StorageTool format -t "$cluster_id" -c "$props" "${FORMAT_EXTRA[@]}" \
            >>"$LOGS/$name/format.log" 2>&1 || die "formatting $name storage failed, see $LOGS/$name/format.log"
    fi
    log "starting $name (heap $heap), log $LOGS/$name/kafka.log"
    spawn "$name" "${java[0]}" -Xms"$heap" -Xmx"$heap" -XX:+UseG1GC \
        -Djava.awt.headless=true "${java[@]:1}" kafka.Kafka "$props"
}

launch_kafka() {
    fetch_libs kafka
    local id
    id=$(kafka_cluster_id kafka) || die "no kafka cluster id"
    kafka_jvm kafka "$CONF/kafka/server.properties" "$KAFKA_HEAP" "$id"
}

# Broker $3 (1-3) of the cluster on address $2; all three are controllers.
launch_kafka_node() {
    local name=$1 host=$2 n=$3 base="$STACK/$1/base.properties"
    fetch_libs kafka
    mkdir -p "$STACK/$name"
    sed -e "s/^node.id=.*/node.id=$n/" \
        -e "s/^controller.quorum.voters=.*/controller.quorum.voters=1@127.0.0.1:9093,2@127.0.0.2:9093,3@127.0.0.3:9093/" \
        -e "s#^listeners=.*#listeners=PLAINTEXT://$host:9092,CONTROLLER://$host:9093#" \
        -e "s#^advertised.listeners=.*#advertised.listeners=PLAINTEXT://$host:9092#" \
        -e "s/replication.factor=1/replication.factor=3/" \
        -e "s/min.isr=1/min.isr=2/" \
        "$CONF/kafka/server.properties" >"$base"
    printf 'default.replication.factor=3\nmin.insync.replicas=2\n' >>"$base"
    local id
    id=$(kafka_cluster_id cluster) || die "no kafka cluster id"
    kafka_jvm "$name" "$base" "$CLUSTER_KAFKA_HEAP" "$id"
}

# One id per Kafka cluster, made once: the three brokers must share it.
kafka_cluster_id() {
    local file="$STACK/kafka-$1.id"
    if [ ! -s "$file" ]; then
        mkdir -p "$LOGS"
        "$JAVA_HOME/bin/java" -cp "$STACK/lib/kafka/*" kafka.tools.StorageTool random-uuid \
            >"$file" 2>>"$LOGS/kafka-format.log" || die "no kafka cluster id, see $LOGS/kafka-format.log"
    fi
    cat "$file"
}

launch_redis() {
    mkdir -p "$STACK/redis"
    log "starting redis, log $LOGS/redis.log"
    # The cache is rebuilt from Cassandra, so no persistence is wanted.
    spawn redis redis-server --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
        --dir "$STACK/redis" --logfile "$LOGS/redis.log" --daemonize no
}

stop_one() {
    ask_to_stop "$1" "$2" && await_stop "$1"
    return 0
}

# Sends SIGTERM to one server this script started; false when none runs.
ask_to_stop() {
    local name=$1 pattern=$2 pid
    if ! running "$name" "$pattern"; then
        rm -f "$RUN/$name.pid"
        return 1
    fi
    pid=$(pid_of "$name")
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
}

# Waits up to 60 s for a server asked to stop, then kills it.
await_stop() {
    local name=$1 pid
    pid=$(pid_of "$name") || return 0
    local deadline=$((SECONDS + 60)) killed=
    while kill -0 "$pid" 2>/dev/null; do
        # Once: a killed JVM can take a few polls to be gone.
        if [ -z "$killed" ] && [ "$SECONDS" -ge "$deadline" ]; then
            log "$name did not stop within 60s; killing it"
            kill -KILL "$pid" 2>/dev/null || true
            killed=1
        fi
        sleep 0.5
    done
    rm -f "$RUN/$name.pid"
}

status_one() {
    local name=$1 pattern=$2 kind=$3 host=$4 port=$5 state answers
    if running "$name" "$pattern"; then state="running (pid $(pid_of "$name"))"; else state="not started by this script"; fi
    if probe "$kind" "$host" "$port"; then answers="answers on $host:$port"; else answers="no answer on $host:$port"; fi
    printf '%-10s %-32s %s\n' "$name" "$state" "$answers"
}

each_server() {
    echo "$SERVERS" | awk 'NF {print $1}'
}

main() {
    mkdir -p "$LOGS" "$RUN"
    local name pattern kind host port
    use_mode "$(mode)"
    case "${1:-}" in
        install)
            ensure_packages
            fetch_libs cassandra
            fetch_libs kafka
            ;;
        up)
            local want=single
            case "${2:-}" in
                "") ;;
                --cluster) want=cluster ;;
                --secure) want=secure ;;
                *) die "unknown option ${2}; usage: $0 up [--cluster|--secure]" ;;
            esac
            if [ "$(mode)" != "$want" ] && any_running; then
                die "the $(mode) stack is running; run '$0 down' first (both use 127.0.0.1:9042 and :9092)"
            fi
            use_mode "$want"
            echo "$want" >"$MODE_FILE"
            ensure_packages
            # Launch everything first, then wait: the JVMs start side by side.
            local launched=()
            for name in $(each_server); do
                if launch_unless_running "$name"; then launched+=("$name"); fi
            done
            for name in "${launched[@]}"; do await "$name"; done
            [ "$want" = secure ] && secure_setup
            if [ "$want" = cluster ]; then
                log "cluster is up: cassandra and kafka on 127.0.0.1-3 (:9042, :9092), redis 127.0.0.1:6379 (logs in $LOGS)"
            elif [ "$want" = secure ]; then
                log "secure stack is up: cassandra 127.0.0.1:9042, kafka 127.0.0.1:9092 (SASL_SSL), redis 127.0.0.1:6379, all TLS (logs in $LOGS)"
            else
                log "stack is up: cassandra 127.0.0.1:9042, kafka 127.0.0.1:9092, redis 127.0.0.1:6379 (logs in $LOGS)"
            fi
            ;;
        down)
            # All at once: a KRaft broker whose fellow controllers are
            # already gone can hang in its shutdown.
            local stopping=()
            for name in $(each_server | tac); do
                read -r name pattern kind host port <<<"$(server_row "$name")"
                if ask_to_stop "$name" "$pattern"; then stopping+=("$name"); fi
            done
            for name in "${stopping[@]}"; do await_stop "$name"; done
            rm -f "$MODE_FILE"
            ;;
        status)
            echo "mode: $(mode)"
            for name in $(each_server | tac); do
                read -r name pattern kind host port <<<"$(server_row "$name")"
                status_one "$name" "$pattern" "$kind" "$host" "$port"
            done
            ;;
        stop)
            [ -n "${2:-}" ] || { echo "usage: $0 stop $(each_server | paste -sd'|')" >&2; exit 2; }
            read -r name pattern kind host port <<<"$(server_row "$2")"
            stop_one "$name" "$pattern"
            ;;
        start)
            [ -n "${2:-}" ] || { echo "usage: $0 start $(each_server | paste -sd'|')" >&2; exit 2; }
            ensure_packages
            start "$2"
            ;;
        restart)
            [ -n "${2:-}" ] || { echo "usage: $0 restart $(each_server | paste -sd'|')" >&2; exit 2; }
            read -r name pattern kind host port <<<"$(server_row "$2")"
            ensure_packages
            stop_one "$name" "$pattern"
            start "$name"
            ;;
        pid)
            [ -n "${2:-}" ] || { echo "usage: $0 pid $(each_server | paste -sd'|')" >&2; exit 2; }
            read -r name pattern kind host port <<<"$(server_row "$2")"
            running "$name" "$pattern" || die "$name is not running"
            pid_of "$name"
            ;;
        logs)
            echo "$LOGS"
            ls -1 "$LOGS"
            ;;
        nodetool)
            # Against the first node's local-only JMX port (7200 in cluster mode).
            shift
            local jmx=7199
            [ "$(mode)" = cluster ] && jmx=7200
            cassandra_tool org.apache.cassandra.tools.NodeTool -h 127.0.0.1 -p "$jmx" "$@"
            ;;
        sstablepartitions)
            shift
            cassandra_tool org.apache.cassandra.tools.SSTablePartitions "$@"
            ;;
        *)
            echo "usage: $0 install|up [--cluster|--secure]|down|status|logs|start|stop|restart|pid SERVER|nodetool ARGS|sstablepartitions ARGS" >&2
            exit 2
            ;;
    esac
}

# Runs one of Cassandra's tools ($1 its class) from the installed jars.
cassandra_tool() {
    JAVA_HOME=${JAVA_HOME:-$(find_java17)} || die "no Java 17; run $0 install"
    exec "$JAVA_HOME/bin/java" -Xmx256m -cp "$STACK/lib/cassandra/*" \
        -Dlogback.configurationFile="$CONF/cassandra/logback.xml" -Dcassandra.logdir="$LOGS" \
        "${JVM17_MODULES[@]}" \
        "$@"
}

# True when any server of the current mode's table runs.
any_running() {
    local name pattern kind host port
    for name in $(each_server); do
        read -r name pattern kind host port <<<"$(server_row "$name")"
        running "$name" "$pattern" && return 0
    done
    return 1
}

main "$@"
