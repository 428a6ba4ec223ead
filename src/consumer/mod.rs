//! `tally consumer`: counts each published transition exactly once into
//! `target_stats`, however often Kafka delivers it.
//!
//! A batch is up to `batch_max` messages or `batch_wait` of time. Its events
//! are grouped by target, and each target gets one fenced write (totals and
//! applied versions in one single-partition conditional batch). Offsets are
//! stored only after every write of the batch has landed; auto-commit then
//! commits them. A crash anywhere replays from the last commit, and the
//! replayed versions are dropped by the apply rule.

pub mod lag;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;
use rdkafka::{Message, Offset, TopicPartitionList};
use tokio::sync::watch;

use crate::bus::KafkaConfig;
use crate::cache::{Cache, RedisConfig};
use crate::domain::{TargetId, Transition, UserId};
use crate::store::reactions::Cas;
use crate::store::stats::{MAX_USERS_PER_WRITE, Stats};
use crate::store::{CassandraConfig, Store};

/// How the consumer writes: `batched` (one fenced write per target per
/// batch) or `per-event` (one per event, the baseline the benches compare).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMode {
    Batched,
    PerEvent,
}

/// Settings of `tally consumer`.
#[derive(clap::Args, Debug, Clone)]
pub struct ConsumerConfig {
    /// Consumer group; run several processes in one group to share partitions.
    #[arg(long, env = "TALLY_CONSUMER_GROUP", default_value = "tally-consumer")]
    pub group: String,

    /// Most messages in one batch.
    #[arg(long = "batch-max", env = "TALLY_BATCH_MAX", default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub batch_max: u64,

    /// Longest a batch waits to fill after its first message.
    #[arg(long = "batch-wait", env = "TALLY_BATCH_WAIT", default_value = "50ms", value_parser = humantime::parse_duration)]
    pub batch_wait: Duration,

    /// Targets written concurrently within one batch.
    #[arg(
        long = "write-parallelism",
        env = "TALLY_WRITE_PARALLELISM",
        default_value_t = 16
    )]
    pub parallelism: usize,

    /// How long a stop (SIGTERM) waits for the batch in hand to be written.
    #[arg(long = "drain-timeout", env = "TALLY_DRAIN_TIMEOUT", default_value = "20s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,

    #[arg(long = "write-mode", env = "TALLY_WRITE_MODE", value_enum, default_value_t = WriteMode::Batched)]
    pub mode: WriteMode,

    /// Address of the consumer's /metrics, /healthz and /readyz (port 0 picks one).
    #[arg(
        long = "listen",
        env = "TALLY_CONSUMER_LISTEN",
        default_value = "127.0.0.1:9091"
    )]
    pub listen: String,

    #[command(flatten)]
    pub cassandra: CassandraConfig,
    #[command(flatten)]
    pub kafka: KafkaConfig,
    #[command(flatten)]
    pub redis: RedisConfig,
}

/// Running counts, shared with tests, metrics and the lag reporter.
#[derive(Debug, Default)]
pub struct Progress {
    /// Messages whose offsets were stored (applied, replayed or dead-lettered).
    pub processed: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub replays: AtomicU64,
    pub gaps: AtomicU64,
    /// Fenced writes that landed.
    pub writes: AtomicU64,
    /// Fenced writes that lost to another writer and were redone.
    pub fence_conflicts: AtomicU64,
    pub batches: AtomicU64,
    /// CQL requests made to count (two reads and one batch per write attempt).
    pub requests: AtomicU64,
    /// The port /metrics, /healthz and /readyz are served on.
    pub ops_port: AtomicU64,
}

/// Runs until `stop` turns true, then finishes the batch in hand (up to
/// `drain_timeout`), commits what was written, and leaves the group.
pub async fn run(
    config: ConsumerConfig,
    mut stop: watch::Receiver<bool>,
    progress: Arc<Progress>,
) -> anyhow::Result<()> {
    let store = Arc::new(Store::open(&config.cassandra, Duration::from_secs(1)).await?);
    let consumer: Arc<StreamConsumer> = Arc::new(
        config
            .kafka
            .client()
            .set("group.id", &config.group)
            .set("enable.auto.commit", "true")
            .set("auto.commit.interval.ms", "1000")
            // Offsets are stored by hand, after the write (see module docs).
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", "10000")
            .set("heartbeat.interval.ms", "1000")
            .create()
            .context("Failed to create the Kafka consumer")?,
    );
    consumer
        .subscribe(&[&config.kafka.topic])
        .context("Failed to subscribe")?;
    let dead_letters: FutureProducer = config
        .kafka
        .client()
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .context("Failed to create the dead-letter producer")?;
    let cache = Cache::new(&config.redis, Duration::from_secs(60))?;
    let readiness = crate::ops::Readiness::new(store.clone(), &config.kafka, cache.clone())?;
    let (port, ops_server) =
        crate::ops::serve(&config.listen, readiness, crate::metrics::install())?;
    progress.ops_port.store(u64::from(port), Ordering::Relaxed);
    let ops_handle = ops_server.handle();
    tokio::spawn(ops_server);
    let positions = lag::Positions::default();
    let lag_task = tokio::spawn(lag::report(
        consumer.clone(),
        config.kafka.topic.clone(),
        positions.clone(),
        stop.clone(),
    ));
    tracing::info!(group = %config.group, topic = %config.kafka.topic, mode = ?config.mode, "tally consumer started");

    let worker = Worker {
        config: &config,
        stats: &store.stats,
        dead_letters: &dead_letters,
        progress: &progress,
    };
    let result = loop {
        if *stop.borrow() {
            break Ok(());
        }
        let batch = tokio::select! {
            b = gather(&consumer, config.batch_max, config.batch_wait) => b,
            _ = stop.changed() => continue,
        };
        if batch.is_empty() {
            continue;
        }
        // Finish the batch in hand even after a stop, within the drain timeout.
        let written = tokio::select! {
            r = worker.process(&batch, &stop) => r,
            () = drain_deadline(stop.clone(), config.drain_timeout) => Err(anyhow::anyhow!("drain timeout: batch abandoned, it will be replayed")),
        };
        match written {
            Ok(()) => {
                store_offsets(&consumer, &config.kafka.topic, &batch);
                positions.advance(&batch);
                progress
                    .processed
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
                progress.batches.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => break Err(e),
        }
    };

    // Commit what was stored, synchronously, then leave the group.
    if let Err(e) = consumer.commit_consumer_state(CommitMode::Sync) {
        tracing::debug!(error = %e, "final commit had nothing to do or failed");
    }
    consumer.unsubscribe();
    lag_task.abort();
    ops_handle.stop(true).await;
    tracing::info!(
        processed = progress.processed.load(Ordering::Relaxed),
        "tally consumer stopped"
    );
    result
}

async fn drain_deadline(mut stop: watch::Receiver<bool>, timeout: Duration) {
    let _ = stop.wait_for(|s| *s).await;
    tokio::time::sleep(timeout).await;
}

/// Waits for a first message, then takes more until the batch is full or
/// `wait` has passed.
async fn gather(consumer: &StreamConsumer, max: u64, wait: Duration) -> Vec<OwnedMessage> {
    let mut batch = Vec::new();
    let mut stream = consumer.stream();
    let deadline = tokio::time::Instant::now() + wait;
    while (batch.len() as u64) < max {
        let next = if batch.is_empty() {
            stream.next().await
        } else {
            match tokio::time::timeout_at(deadline, stream.next()).await {
                Ok(m) => m,
                Err(_) => break,
            }
        };
        match next {
            Some(Ok(m)) => batch.push(m.detach()),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "Kafka error while consuming");
                if batch.is_empty() {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                break;
            }
            None => break,
        }
    }
    batch
}

/// Stores, per partition, the offset after the batch's last message. Stored
/// offsets of partitions revoked meanwhile are refused; their new owner
/// replays those messages, which the apply rule makes harmless.
fn store_offsets(consumer: &StreamConsumer, topic: &str, batch: &[OwnedMessage]) {
    let mut next: BTreeMap<i32, i64> = BTreeMap::new();
    for m in batch {
        let e = next.entry(m.partition()).or_insert(0);
        *e = (*e).max(m.offset() + 1);
    }
    let mut tpl = TopicPartitionList::new();
    for (p, o) in next {
        let _ = tpl.add_partition_offset(topic, p, Offset::Offset(o));
    }
    if let Err(e) = consumer.store_offsets(&tpl) {
        tracing::info!(error = %e, "some offsets not stored (partition revoked?); they will be replayed");
    }
}

struct Worker<'a> {
    config: &'a ConsumerConfig,
    stats: &'a Stats,
    dead_letters: &'a FutureProducer,
    progress: &'a Progress,
}

impl Worker<'_> {
    /// Writes everything a batch means. Returns only when all of it landed
    /// (or the consumer is stopping and gave up, in which case no offset of
    /// this batch may be stored).
    async fn process(
        &self,
        batch: &[OwnedMessage],
        stop: &watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        let mut by_target: HashMap<TargetId, Vec<Transition>> = HashMap::new();
        for m in batch {
            match Transition::from_json(m.payload().unwrap_or_default()) {
                Ok(t) => by_target.entry(t.target_id.clone()).or_default().push(t),
                Err(reason) => self.dead_letter(m, &reason.to_string(), stop).await?,
            }
        }
        let writes = by_target
            .into_iter()
            .map(|(target, events)| async move { self.apply_target(&target, &events, stop).await });
        let results: Vec<anyhow::Result<()>> = futures::stream::iter(writes)
            .buffer_unordered(self.config.parallelism.max(1))
            .collect()
            .await;
        results.into_iter().collect()
    }

    /// Folds a target's events into its ledger and writes the result, in
    /// chunks of at most `MAX_USERS_PER_WRITE` users (one event per chunk in
    /// per-event mode). Retries until each write lands.
    async fn apply_target(
        &self,
        target: &TargetId,
        events: &[Transition],
        stop: &watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        let per_chunk = match self.config.mode {
            WriteMode::Batched => MAX_USERS_PER_WRITE,
            WriteMode::PerEvent => 1,
        };
        for chunk in chunks_by_users(events, per_chunk) {
            let mut users: Vec<&UserId> = chunk.iter().map(|t| &t.user_id).collect();
            users.sort_unstable();
            users.dedup();
            let mut serial = false;
            let mut backoff = Duration::from_millis(50);
            loop {
                self.progress.requests.fetch_add(2, Ordering::Relaxed);
                let outcome = match self.stats.read(target, Some(&users), serial).await {
                    Ok(read) => {
                        let mut ledger = read.ledger;
                        for t in chunk {
                            ledger.apply(&t.user_id, t.version, Some(t.from), t.to);
                        }
                        if ledger.changed.is_empty() {
                            metrics::counter!(crate::metrics::EVENTS, "result" => "replay")
                                .increment(ledger.replays);
                            self.progress
                                .replays
                                .fetch_add(ledger.replays, Ordering::Relaxed);
                            break;
                        }
                        let changed: Vec<&UserId> = ledger.changed.iter().collect();
                        self.progress.requests.fetch_add(1, Ordering::Relaxed);
                        let written = self
                            .stats
                            .write(
                                target,
                                Some(chunk[0].target_type),
                                read.seq,
                                &ledger,
                                &changed,
                            )
                            .await;
                        crate::metrics::cas("stats", &written);
                        match written {
                            Cas::Applied => {
                                metrics::counter!(crate::metrics::EVENTS, "result" => "applied")
                                    .increment(chunk.len() as u64 - ledger.replays);
                                metrics::counter!(crate::metrics::EVENTS, "result" => "replay")
                                    .increment(ledger.replays);
                                metrics::counter!(crate::metrics::GAPS).increment(ledger.gaps);
                                self.progress.writes.fetch_add(1, Ordering::Relaxed);
                                self.progress
                                    .replays
                                    .fetch_add(ledger.replays, Ordering::Relaxed);
                                self.progress.gaps.fetch_add(ledger.gaps, Ordering::Relaxed);
                                if ledger.gaps > 0 {
                                    tracing::info!(target_id = %target, gaps = ledger.gaps, "transitions arrived out of order or were lost; counted from the applied state");
                                }
                                break;
                            }
                            // Another writer moved the fence, or our write may
                            // have landed: re-read at SERIAL and fold again. If
                            // it landed, the versions are now replays.
                            Cas::NotApplied => {
                                self.progress
                                    .fence_conflicts
                                    .fetch_add(1, Ordering::Relaxed);
                                Ok(())
                            }
                            Cas::Unknown(e) => {
                                tracing::warn!(target_id = %target, error = %e, "stats write outcome unknown; re-reading at SERIAL");
                                Ok(())
                            }
                            Cas::Failed(e) => Err(e),
                        }
                    }
                    Err(e) => Err(e.into()),
                };
                serial = true;
                if let Err(e) = outcome {
                    if *stop.borrow() && backoff >= Duration::from_secs(2) {
                        anyhow::bail!("stopping while Cassandra is failing: {e:#}");
                    }
                    tracing::warn!(target_id = %target, error = format!("{e:#}"), "stats write failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
        Ok(())
    }

    /// Sends an event the consumer cannot apply to the dead-letter topic,
    /// with the reason and its origin in headers, and waits until Kafka has
    /// it: a poison message is never silently skipped, and never blocks.
    async fn dead_letter(
        &self,
        m: &OwnedMessage,
        reason: &str,
        stop: &watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        let (partition, offset) = (m.partition().to_string(), m.offset().to_string());
        loop {
            let headers = OwnedHeaders::new()
                .insert(Header {
                    key: "tally-dlq-reason",
                    value: Some(reason),
                })
                .insert(Header {
                    key: "tally-source-topic",
                    value: Some(m.topic()),
                })
                .insert(Header {
                    key: "tally-source-partition",
                    value: Some(&partition),
                })
                .insert(Header {
                    key: "tally-source-offset",
                    value: Some(&offset),
                });
            let mut record = FutureRecord::to(&self.config.kafka.dead_letter_topic)
                .payload(m.payload().unwrap_or_default())
                .headers(headers);
            if let Some(key) = m.key() {
                record = record.key(key);
            }
            match self
                .dead_letters
                .send(record, Timeout::After(Duration::from_secs(5)))
                .await
            {
                Ok(_) => {
                    self.progress.dead_lettered.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!(crate::metrics::DEAD_LETTERED).increment(1);
                    tracing::warn!(
                        partition = m.partition(),
                        offset = m.offset(),
                        reason,
                        "event dead-lettered"
                    );
                    return Ok(());
                }
                Err((e, _)) if !*stop.borrow() => {
                    tracing::warn!(error = %e, "dead-letter publish failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err((e, _)) => anyhow::bail!(
                    "stopping before a poison message reached the dead-letter topic: {e}"
                ),
            }
        }
    }
}

/// Splits a target's events, in order, into runs with at most `max` users.
fn chunks_by_users(events: &[Transition], max: usize) -> Vec<&[Transition]> {
    let mut out = Vec::new();
    let (mut start, mut users): (usize, Vec<&UserId>) = (0, Vec::new());
    for (i, t) in events.iter().enumerate() {
        if !users.contains(&&t.user_id) {
            if users.len() == max {
                out.push(&events[start..i]);
                start = i;
                users.clear();
            }
            users.push(&t.user_id);
        }
    }
    if start < events.len() {
        out.push(&events[start..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Reaction, TargetType};

    fn ev(user: &str, version: i64) -> Transition {
        Transition {
            target_id: TargetId::parse("t").unwrap_or_else(|e| panic!("{e}")),
            target_type: TargetType::Video,
            user_id: UserId::parse(user).unwrap_or_else(|e| panic!("{e}")),
            from: Reaction::None,
            to: Reaction::Like,
            version,
            occurred_at: String::new(),
        }
    }

    #[test]
    fn chunks_keep_order_and_bound_distinct_users() {
        let events = [
            ev("a", 1),
            ev("b", 1),
            ev("a", 2),
            ev("c", 1),
            ev("b", 2),
            ev("d", 1),
        ];
        let chunks = chunks_by_users(&events, 2);
        let shape: Vec<Vec<(&str, i64)>> = chunks
            .iter()
            .map(|c| c.iter().map(|t| (t.user_id.as_str(), t.version)).collect())
            .collect();
        assert_eq!(
            shape,
            vec![
                vec![("a", 1), ("b", 1), ("a", 2)],
                vec![("c", 1), ("b", 2)],
                vec![("d", 1)]
            ]
        );
        assert_eq!(chunks_by_users(&events, 1).len(), 6);
        assert!(chunks_by_users(&[], 3).is_empty());
    }
}
