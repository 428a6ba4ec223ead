//! Prometheus metrics: every name tally exports is defined here, with the
//! signal it serves (docs/operations.md has the thresholds).

use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Signal 1: vote write latency, by outcome.
pub const VOTE_WRITE_SECONDS: &str = "tally_vote_write_seconds";
/// Signal 2: summary read latency.
pub const VOTE_READ_SECONDS: &str = "tally_vote_read_seconds";
/// Signal 3: consumer lag, per partition.
pub const CONSUMER_LAG_MESSAGES: &str = "tally_consumer_lag_messages";
pub const CONSUMER_LAG_SECONDS: &str = "tally_consumer_lag_seconds";
/// Written batches whose offsets wait for the cache drops they owe (batches
/// that owe the same drops count as one, and past 1,000 every newer batch
/// joins the last): the group's committed lag grows while this is above zero.
pub const CONSUMER_BATCHES_HELD: &str = "tally_consumer_batches_held";
/// Signal 3, seen from the vote API: the group's lag from committed offsets.
pub const GROUP_LAG_MESSAGES: &str = "tally_consumer_group_lag_messages";
pub const GROUP_LAG_SECONDS: &str = "tally_consumer_group_lag_seconds";
/// Signal 4: count cache lookups, by result (hit, miss, error).
pub const CACHE_LOOKUPS: &str = "tally_cache_lookups_total";
/// Cache misses filled, by what was read: `registry` (no reaction yet,
/// served as zeros), `buckets` (every bucket's head) or `joined` (nothing:
/// the miss was served what a fill of the same entry in flight put there).
pub const CACHE_FILLS: &str = "tally_cache_fills_total";
/// Fills that found their entry dropped after they armed its fence, by
/// step (read, vote): their heads may predate a write whose base the drop
/// took, so they are not written.
pub const CACHE_FILLS_FENCED: &str = "tally_cache_fills_fenced_total";
/// Writes of a change to an entry that Redis answered with an error (out of
/// memory, say), by step (vote, write_through, settle, drop_behind); each entry is then dropped.
pub const CACHE_WRITES_REFUSED: &str = "tally_cache_writes_refused_total";
/// Entries a vote's change, a write through, a settle or a check against
/// the head could not reach (Redis did not answer), to be dropped once it
/// does: each may serve older totals until then.
pub const CACHE_DROPS_OWED: &str = "tally_cache_drops_owed";
/// Signal 5: conditional writes, by statement (vote, stats) and outcome
/// (applied, not_applied, unknown, failed).
pub const CAS: &str = "tally_cas_total";
/// Votes whose conditional write timed out, by what the SERIAL read after
/// it found: applied, not_applied, or unresolved (the read kept failing).
pub const UNKNOWN_RESOLVED: &str = "tally_unknown_outcomes_total";
/// Signal 6: drift found and repaired by reconcile.
pub const DRIFT_FOUND: &str = "tally_reconcile_drift_found_total";
pub const DRIFT_REPAIRED: &str = "tally_reconcile_drift_repaired_total";
pub const RECONCILE_CHECKED: &str = "tally_reconcile_targets_checked_total";
/// Cache entries reconcile found behind the durable totals of a bucket it
/// found counted (a write that landed without its write through).
pub const RECONCILE_ENTRIES_BEHIND: &str = "tally_reconcile_cache_entries_behind_total";
/// Committed transitions Kafka did not take when they were cast; the relay
/// publishes them from the outbox.
pub const PUBLISH_DEFERRED: &str = "tally_publish_deferred_total";
/// The outbox: intents the relay found not yet resolved in its last pass,
/// and how old the oldest of them is.
pub const OUTBOX_BACKLOG: &str = "tally_outbox_backlog";
pub const OUTBOX_OLDEST_SECONDS: &str = "tally_outbox_oldest_seconds";
/// Transitions the relay published from the outbox.
pub const RELAY_PUBLISHED: &str = "tally_relay_published_total";
/// Replays of a key that published its transition again.
pub const REPLAYS_REPUBLISHED: &str = "tally_replays_republished_total";
/// Whether each dependency answered its last check (1) or not (0).
pub const DEPENDENCY_UP: &str = "tally_dependency_up";
/// How far Redis's clock is ahead of this process's (behind when
/// negative), as its `TIME` answered the last check.
pub const REDIS_CLOCK_OFFSET: &str = "tally_redis_clock_offset_seconds";
/// Give or take: half the round trip of the measurement kept.
pub const REDIS_CLOCK_UNCERTAINTY: &str = "tally_redis_clock_uncertainty_seconds";
/// Votes taken without checking the user's count of the day (Redis did not answer).
pub const DAILY_UNCHECKED: &str = "tally_daily_limit_unchecked_total";
/// Events sent to the dead-letter topic, by cause (invalid, parked).
pub const DEAD_LETTERED: &str = "tally_consumer_dead_lettered_total";
pub const GAPS: &str = "tally_consumer_gaps_total";
/// Events counted by the consumer, by result (applied, replay).
pub const EVENTS: &str = "tally_consumer_events_total";
/// How the consumer checked each event's provenance (signature, row,
/// row_bad_signature, row_unsigned, row_unverified).
pub const EVENT_CHECKS: &str = "tally_consumer_event_checks_total";
pub const HTTP_RESPONSES: &str = "tally_http_responses_total";
/// The adaptive admission limit, by kind (vote, summary).
pub const ADMISSION_LIMIT: &str = "tally_admission_limit";
/// Requests refused by admission (503), by kind.
pub const ADMISSION_REFUSED: &str = "tally_admission_refused_total";
/// Refusals that waited their turn (`--admission-refusal-ratio`), by kind.
pub const ADMISSION_PACED: &str = "tally_admission_refusals_paced_total";

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide recorder once and returns the handle that
/// renders `/metrics`. Later calls (tests start many apps) reuse it.
pub fn install() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let latency = [
                0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ];
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &latency)
                .unwrap_or_else(|_| PrometheusBuilder::new());
            match builder.install_recorder() {
                Ok(handle) => {
                    describe();
                    let upkeep = handle.clone();
                    // The exporter needs periodic upkeep to drain histograms.
                    std::thread::spawn(move || {
                        loop {
                            std::thread::sleep(Duration::from_secs(5));
                            upkeep.run_upkeep();
                        }
                    });
                    handle
                }
                // Another recorder is installed: render an empty one.
                Err(_) => PrometheusBuilder::new().build_recorder().handle(),
            }
        })
        .clone()
}

fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_histogram!(
        VOTE_WRITE_SECONDS,
        Unit::Seconds,
        "POST /v1/votes latency by outcome (p95 target 100 ms)"
    );
    describe_histogram!(
        VOTE_READ_SECONDS,
        Unit::Seconds,
        "GET /v1/votes/summary latency (p95 target 20 ms)"
    );
    describe_gauge!(
        REDIS_CLOCK_OFFSET,
        Unit::Seconds,
        "how far Redis's clock is ahead of this host's (negative: behind), from TIME every 5 s (NaN when Redis did not answer); a vote's cache step allows 0.1 s, and hosts' offsets differ by their clocks' skew"
    );
    describe_gauge!(
        REDIS_CLOCK_UNCERTAINTY,
        Unit::Seconds,
        "how uncertain tally_redis_clock_offset_seconds is: half the round trip of the TIME it was measured with"
    );
    describe_gauge!(
        CONSUMER_LAG_MESSAGES,
        "messages the consumer is behind, per partition"
    );
    describe_gauge!(
        CONSUMER_LAG_SECONDS,
        Unit::Seconds,
        "age of the oldest unprocessed event, per partition"
    );
    describe_gauge!(
        CONSUMER_BATCHES_HELD,
        "written batches whose offsets wait until the cache drops they owe are sent (those owing the same drops count as one, at most 1000); a consumer killed meanwhile leaves them to be replayed"
    );
    describe_gauge!(
        GROUP_LAG_MESSAGES,
        "messages the consumer group is behind, per partition, from its committed offsets"
    );
    describe_gauge!(
        GROUP_LAG_SECONDS,
        Unit::Seconds,
        "age of the oldest message the group has not committed, per partition"
    );
    describe_counter!(
        CACHE_LOOKUPS,
        "count cache lookups by result (hit, miss, error)"
    );
    describe_counter!(
        CACHE_FILLS,
        "cache misses filled by what was read (registry: nobody reacted yet; buckets; joined: a fill of the same entry in flight, nothing read; cache: the entry, filled while the miss waited)"
    );
    describe_counter!(
        CACHE_FILLS_FENCED,
        "fills not written because their entry was dropped after they armed its fence, by step (read, vote)"
    );
    describe_counter!(
        CACHE_WRITES_REFUSED,
        "changes Redis refused to write to an entry, by step (vote, write_through, settle, drop_behind); the entry is dropped"
    );
    describe_gauge!(
        CACHE_DROPS_OWED,
        "cache entries a vote's change, a write through, a settle or a check against the durable head could not reach, dropped once Redis answers; until then they may serve older totals"
    );
    describe_counter!(
        CAS,
        "conditional writes by statement (vote, stats) and outcome (applied, not_applied, unknown, failed)"
    );
    describe_counter!(
        DRIFT_FOUND,
        "targets whose totals disagreed with the per-user rows"
    );
    describe_counter!(DRIFT_REPAIRED, "drifted targets repaired");
    describe_counter!(RECONCILE_CHECKED, "targets recounted");
    describe_counter!(
        RECONCILE_ENTRIES_BEHIND,
        "cache entries dropped for a base older than a durable head, or a fill that may have read older heads"
    );
    describe_counter!(
        PUBLISH_DEFERRED,
        "committed transitions Kafka did not take at once; the relay publishes them"
    );
    describe_gauge!(
        OUTBOX_BACKLOG,
        "outbox intents not yet resolved, as of the relay's last pass"
    );
    describe_gauge!(
        OUTBOX_OLDEST_SECONDS,
        Unit::Seconds,
        "age of the oldest unresolved outbox intent"
    );
    describe_counter!(
        RELAY_PUBLISHED,
        "transitions the relay published from the outbox"
    );
    describe_counter!(
        REPLAYS_REPUBLISHED,
        "replays of a key that published its transition again"
    );
    describe_gauge!(
        DEPENDENCY_UP,
        "whether a dependency answered its last check (1) or not (0)"
    );
    describe_counter!(
        DAILY_UNCHECKED,
        "votes taken without checking the user's count of the day, because Redis did not answer"
    );
    describe_counter!(
        DEAD_LETTERED,
        "events sent to the dead-letter topic, by cause (invalid: it does not parse; parked: its bucket kept failing)"
    );
    describe_counter!(
        GAPS,
        "transitions whose from was not the counted state (lost or reordered events)"
    );
    describe_counter!(EVENTS, "transitions counted by result (applied, replay)");
    describe_counter!(
        EVENT_CHECKS,
        "how the consumer checked that each event came from the vote API (signature: its signature verified, no read; row: read against the user's row, no key on either side; row_bad_signature: signed, but not with the consumer's key, or altered; row_unsigned: no signature though the consumer has a key; row_unverified: signed, but the consumer has no key)"
    );
    describe_counter!(HTTP_RESPONSES, "HTTP responses by status");
    describe_gauge!(
        ADMISSION_LIMIT,
        "requests of a kind (vote, summary) admitted at once, adapted to their latency"
    );
    describe_counter!(
        ADMISSION_REFUSED,
        "requests refused with 503 because the admission limit was reached, by kind"
    );
    describe_counter!(
        ADMISSION_PACED,
        "refusals answered late because refusals outran the admitted requests completed, by kind"
    );
    describe_counter!(
        UNKNOWN_RESOLVED,
        "votes whose conditional write timed out, by what the SERIAL read found"
    );
}

/// Counts how an unknown outcome of a vote ended.
pub fn unknown_resolved(resolution: &'static str) {
    metrics::counter!(UNKNOWN_RESOLVED, "resolved" => resolution).increment(1);
}

/// Counts a conditional write's outcome.
pub fn cas(statement: &'static str, outcome: &crate::store::Cas) {
    use crate::store::Cas;
    let outcome = match outcome {
        Cas::Applied => "applied",
        Cas::NotApplied => "not_applied",
        Cas::Unknown(_) => "unknown",
        Cas::Failed(_) => "failed",
    };
    cas_outcome(statement, outcome);
}

/// Counts one conditional write's outcome, by its name.
pub fn cas_outcome(statement: &'static str, outcome: &'static str) {
    metrics::counter!(CAS, "statement" => statement, "outcome" => outcome).increment(1);
}
