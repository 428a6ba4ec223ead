# The secure stack (`scripts/stack.sh up --secure`), sourced by stack.sh:
# the same three servers on the same ports, each wanting TLS and a login.
#
# - A throwaway CA made with openssl signs one server certificate that names
#   127.0.0.1-3 and localhost. Everything lives in $SECURE, mode 700.
# - Cassandra: PasswordAuthenticator and CassandraAuthorizer, client
#   encryption required. The role `tally` may do anything in any keyspace
#   (it migrates); the default superuser's password is replaced.
# - Kafka: SASL/SCRAM-SHA-512 over TLS for clients and between brokers,
#   StandardAuthorizer with ACLs. `tally-vote` may only produce transitions,
#   `tally-consumer` only read them and write dead letters; `tally-admin`
#   (migrations, tests) and the broker's own `admin` are super users. The
#   controller listener takes TLS with a client certificate only.
# - Redis: TLS only, the `default` user off, the ACL user `tally`.
#
# Random passwords (and the key the vote API signs transitions with) are
# written once to $SECURE/passwords.env, and each
# role's TALLY_* variables to $SECURE/{admin,vote,consumer}.env, for
# `set -a; . .stack/secure/vote.env` before `tally vote`.

SECURE="$STACK/secure"

# Topic and group names the ACLs cover: the production names, and prefixes
# for tests (tx- transitions, dlq- dead letters, g- groups).
SECURE_TOPIC=vote-transitions
SECURE_DLQ=vote-transitions.dlq
SECURE_GROUP=tally-consumer

secure_secrets() {
    if [ -s "$SECURE/passwords.env" ] && [ -s "$SECURE/server.p12" ]; then
        # A folder made before the event signing key: add one, and write
        # the roles' variables again with it.
        if ! grep -q '^EVENT_SIGNING_KEY=' "$SECURE/passwords.env"; then
            echo "EVENT_SIGNING_KEY=$(openssl rand -hex 32)" >>"$SECURE/passwords.env"
            # shellcheck disable=SC1091
            . "$SECURE/passwords.env"
            secure_role_env admin tally-admin "$KAFKA_TALLY_ADMIN_PASSWORD"
            secure_role_env vote tally-vote "$KAFKA_VOTE_PASSWORD"
            secure_role_env consumer tally-consumer "$KAFKA_CONSUMER_PASSWORD"
        fi
        return 0
    fi
    command -v openssl >/dev/null || apt_install openssl
    mkdir -p "$SECURE"
    chmod 700 "$SECURE"
    log "making a throwaway CA and the servers' certificate in $SECURE"
    local ossl="$LOGS/openssl.log"
    (
        cd "$SECURE"
        openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 365 \
            -subj "/CN=tally local stack CA" >>"$ossl" 2>&1
        openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr \
            -subj "/CN=tally-local-server" >>"$ossl" 2>&1
        printf '%s\n' "subjectAltName=IP:127.0.0.1,IP:127.0.0.2,IP:127.0.0.3,DNS:localhost" \
            "extendedKeyUsage=serverAuth,clientAuth" >server.ext
        openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
            -out server.pem -days 365 -extfile server.ext >>"$ossl" 2>&1
    ) || die "openssl failed, see $ossl"
    local pw
    pw() { openssl rand -hex 16; }
    {
        echo "KEYSTORE_PASSWORD=$(pw)"
        echo "CASSANDRA_ADMIN_PASSWORD=$(pw)"
        echo "CASSANDRA_TALLY_PASSWORD=$(pw)"
        echo "KAFKA_ADMIN_PASSWORD=$(pw)"
        echo "KAFKA_TALLY_ADMIN_PASSWORD=$(pw)"
        echo "KAFKA_VOTE_PASSWORD=$(pw)"
        echo "KAFKA_CONSUMER_PASSWORD=$(pw)"
        echo "REDIS_TALLY_PASSWORD=$(pw)"
        echo "EVENT_SIGNING_KEY=$(openssl rand -hex 32)"
    } >"$SECURE/passwords.env.new"
    chmod 600 "$SECURE/passwords.env.new"
    # shellcheck disable=SC1091
    . "$SECURE/passwords.env.new"
    openssl pkcs12 -export -in "$SECURE/server.pem" -inkey "$SECURE/server.key" \
        -certfile "$SECURE/ca.pem" -name tally-local-server -out "$SECURE/server.p12" \
        -passout "pass:$KEYSTORE_PASSWORD" >>"$ossl" 2>&1 || die "openssl pkcs12 failed, see $ossl"
    mv "$SECURE/passwords.env.new" "$SECURE/passwords.env"
    secure_role_env admin tally-admin "$KAFKA_TALLY_ADMIN_PASSWORD"
    secure_role_env vote tally-vote "$KAFKA_VOTE_PASSWORD"
    secure_role_env consumer tally-consumer "$KAFKA_CONSUMER_PASSWORD"
}

# $SECURE/$1.env: the TALLY_* variables of one role, Kafka user $2.
secure_role_env() {
    cat >"$SECURE/$1.env" <<EOF
TALLY_CASSANDRA_USER=tally
TALLY_CASSANDRA_PASSWORD=$CASSANDRA_TALLY_PASSWORD
TALLY_CASSANDRA_TLS_CA=$SECURE/ca.pem
TALLY_KAFKA_SECURITY=sasl-ssl
TALLY_KAFKA_USER=$2
TALLY_KAFKA_PASSWORD=$3
TALLY_KAFKA_TLS_CA=$SECURE/ca.pem
TALLY_REDIS_URL=rediss://127.0.0.1:6379
TALLY_REDIS_USER=tally
TALLY_REDIS_PASSWORD=$REDIS_TALLY_PASSWORD
TALLY_REDIS_TLS_CA=$SECURE/ca.pem
EOF
    # The vote API signs transitions and the consumer verifies them.
    case $1 in
        vote | consumer) echo "TALLY_EVENT_SIGNING_KEY=$EVENT_SIGNING_KEY" >>"$SECURE/$1.env" ;;
    esac
    chmod 600 "$SECURE/$1.env"
}

secure_passwords() {
    secure_secrets
    # shellcheck disable=SC1091
    . "$SECURE/passwords.env"
}

launch_secure_cassandra() {
    secure_passwords
    fetch_libs cassandra
    local dir="$SECURE/cassandra"
    mkdir -p "$dir/data" "$dir/conf" "$LOGS/cassandra"
    {
        sed -e "s/^authenticator: .*/authenticator: PasswordAuthenticator/" \
            -e "s/^authorizer: .*/authorizer: CassandraAuthorizer/" \
            "$CONF/cassandra/cassandra.yaml"
        cat <<EOF
client_encryption_options:
  enabled: true
  optional: false
  keystore: $SECURE/server.p12
  keystore_password: $KEYSTORE_PASSWORD
  store_type: PKCS12
  require_client_auth: false
EOF
    } >"$dir/cassandra.yaml"
    chmod 600 "$dir/cassandra.yaml"
    log "starting cassandra with TLS and logins (heap $CASSANDRA_HEAP), log $LOGS/cassandra/cassandra.log"
    NODE_DATA="$dir/data" cassandra_jvm cassandra "$CASSANDRA_HEAP" "$dir/cassandra.yaml" "$dir/conf" \
        -Dcassandra.jmx.local.port=7199
}

launch_secure_kafka() {
    secure_passwords
    fetch_libs kafka
    local dir="$SECURE/kafka" base
    mkdir -p "$dir"
    base="$dir/base.properties"
    {
        sed -e "s#^listeners=.*#listeners=SASL_SSL://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093#" \
            -e "s#^advertised.listeners=.*#advertised.listeners=SASL_SSL://127.0.0.1:9092#" \
            -e "s#^inter.broker.listener.name=.*#inter.broker.listener.name=SASL_SSL#" \
            -e "s#^listener.security.protocol.map=.*#listener.security.protocol.map=CONTROLLER:SSL,SASL_SSL:SASL_SSL#" \
            "$CONF/kafka/server.properties"
        cat <<EOF
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$KAFKA_ADMIN_PASSWORD";
listener.name.controller.ssl.client.auth=required
ssl.keystore.type=PKCS12
ssl.keystore.location=$SECURE/server.p12
ssl.keystore.password=$KEYSTORE_PASSWORD
ssl.truststore.type=PEM
ssl.truststore.location=$SECURE/ca.pem
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:admin;User:tally-admin;User:CN=tally-local-server
EOF
    } >"$base"
    chmod 600 "$base"
    local id scram=()
    id=$(kafka_cluster_id secure) || die "no kafka cluster id"
    scram+=(--add-scram "SCRAM-SHA-512=[name=admin,password=$KAFKA_ADMIN_PASSWORD]")
    scram+=(--add-scram "SCRAM-SHA-512=[name=tally-admin,password=$KAFKA_TALLY_ADMIN_PASSWORD]")
    scram+=(--add-scram "SCRAM-SHA-512=[name=tally-vote,password=$KAFKA_VOTE_PASSWORD]")
    scram+=(--add-scram "SCRAM-SHA-512=[name=tally-consumer,password=$KAFKA_CONSUMER_PASSWORD]")
    FORMAT_EXTRA=("${scram[@]}")
    NODE_DIR="$dir" kafka_jvm kafka "$base" "$KAFKA_HEAP" "$id"
    FORMAT_EXTRA=()
}

launch_secure_redis() {
    secure_passwords
    mkdir -p "$SECURE/redis"
    log "starting redis with TLS and an ACL user, log $LOGS/redis.log"
    spawn redis redis-server --bind 127.0.0.1 --port 0 --tls-port 6379 \
        --tls-cert-file "$SECURE/server.pem" --tls-key-file "$SECURE/server.key" \
        --tls-ca-cert-file "$SECURE/ca.pem" --tls-auth-clients no \
        --save "" --appendonly no --dir "$SECURE/redis" --logfile "$LOGS/redis.log" --daemonize no \
        --user default off \
        --user tally on ">$REDIS_TALLY_PASSWORD" "~*" "&*" "+@all" "-@dangerous" "+info"
}

# Once the servers answer: Cassandra's roles and Kafka's ACLs, once per
# stack (markers in each server's data).
secure_setup() {
    secure_passwords
    secure_cassandra_roles
    secure_kafka_acls
    log "logins and TLS: the variables of each role are in $SECURE/{admin,vote,consumer}.env"
}

secure_cassandra_roles() {
    local marker="$SECURE/cassandra/data/roles.done"
    [ -f "$marker" ] && return 0
    local deadline=$((SECONDS + 120)) rc
    log "cassandra: creating the role tally, replacing the default superuser's password"
    while :; do
        rc=0
        # The default superuser appears a moment after the node answers.
        CQL_PASSWORD=cassandra python3 "$CONF/cql.py" 127.0.0.1 9042 "$SECURE/ca.pem" cassandra \
            "CREATE ROLE IF NOT EXISTS tally WITH PASSWORD = '$CASSANDRA_TALLY_PASSWORD' AND LOGIN = true" \
            "GRANT ALL PERMISSIONS ON ALL KEYSPACES TO tally" \
            "ALTER ROLE cassandra WITH PASSWORD = '$CASSANDRA_ADMIN_PASSWORD'" \
            2>>"$LOGS/cql.log" || rc=$?
        [ "$rc" = 0 ] && break
        # Already replaced by an earlier run that stopped before its marker.
        if CQL_PASSWORD=$CASSANDRA_ADMIN_PASSWORD python3 "$CONF/cql.py" 127.0.0.1 9042 "$SECURE/ca.pem" cassandra \
            "CREATE ROLE IF NOT EXISTS tally WITH PASSWORD = '$CASSANDRA_TALLY_PASSWORD' AND LOGIN = true" \
            "GRANT ALL PERMISSIONS ON ALL KEYSPACES TO tally" 2>>"$LOGS/cql.log"; then
            break
        fi
        [ "$SECONDS" -lt "$deadline" ] || die "could not set up Cassandra's roles, see $LOGS/cql.log"
        sleep 2
    done
    touch "$marker"
}

secure_kafka_acls() {
    local marker="$SECURE/kafka/data/acls.done"
    [ -f "$marker" ] && return 0
    local admin="$SECURE/kafka/admin.properties"
    cat >"$admin" <<EOF
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$KAFKA_ADMIN_PASSWORD";
ssl.truststore.type=PEM
ssl.truststore.location=$SECURE/ca.pem
EOF
    chmod 600 "$admin"
    log "kafka: ACLs for tally-vote and tally-consumer"
    acl() {
        "$JAVA_HOME/bin/java" -Xmx128m -cp "$STACK/lib/kafka/*" \
            -Dlog4j2.configurationFile="$CONF/kafka/log4j2.xml" -Dkafka.logs.dir="$LOGS/kafka" \
            org.apache.kafka.tools.AclCommand --bootstrap-server 127.0.0.1:9092 \
            --command-config "$admin" --add --force "$@" >>"$LOGS/kafka-acls.log" 2>&1 \
            || die "kafka-acls $* failed, see $LOGS/kafka-acls.log"
    }
    local literal=(--resource-pattern-type literal) prefixed=(--resource-pattern-type prefixed)
    # The vote API: produce transitions; read the consumer group's offsets (its cache TTL follows the lag).
    acl --allow-principal User:tally-vote --operation Write --operation Describe "${literal[@]}" --topic "$SECURE_TOPIC"
    acl --allow-principal User:tally-vote --operation Write --operation Describe "${prefixed[@]}" --topic tx-
    acl --allow-principal User:tally-vote --operation Describe "${literal[@]}" --group "$SECURE_GROUP"
    acl --allow-principal User:tally-vote --operation Describe "${prefixed[@]}" --group g-
    # The consumer: read transitions in its group, write dead letters.
    acl --allow-principal User:tally-consumer --operation Read --operation Describe "${literal[@]}" --topic "$SECURE_TOPIC"
    acl --allow-principal User:tally-consumer --operation Read --operation Describe "${prefixed[@]}" --topic tx-
    acl --allow-principal User:tally-consumer --operation Write --operation Describe "${literal[@]}" --topic "$SECURE_DLQ"
    acl --allow-principal User:tally-consumer --operation Write --operation Describe "${prefixed[@]}" --topic dlq-
    acl --allow-principal User:tally-consumer --operation Read --operation Describe "${literal[@]}" --group "$SECURE_GROUP"
    acl --allow-principal User:tally-consumer --operation Read --operation Describe "${prefixed[@]}" --group g-
    touch "$marker"
}
