//! The consumer's side of Kafka: a group member that hands out batches of
//! plain `Received` messages and stores an offset only when told to.
//!
//! Auto-commit is on, but offsets are stored by hand
//! (`enable.auto.offset.store=false`): a message's offset reaches the commit
//! only after the consumer has written what it means.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Headers};
use rdkafka::{Message, Offset, TopicPartitionList};

use super::KafkaConfig;
use super::lag::{PartitionLag, Positions};

/// One message as the consumer sees it: no Kafka types leave this module.
#[derive(Debug, Clone)]
pub struct Received {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    /// The `tally-signature` header's value, if it has one.
    pub signature: Option<Vec<u8>>,
    /// When Kafka took the message, in ms since the epoch, if it says.
    pub timestamp_ms: Option<i64>,
}

impl Received {
    fn from_kafka(m: &BorrowedMessage<'_>) -> Received {
        Received {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
            signature: m.headers().and_then(|h| {
                h.iter()
                    .find(|h| h.key == super::signature::HEADER)
                    .and_then(|h| h.value.map(<[u8]>::to_vec))
            }),
            timestamp_ms: m.timestamp().to_millis(),
        }
    }
}

/// Per partition, the offset after the last message of some messages: what
/// storing them as processed stores.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Next(BTreeMap<i32, i64>);

impl Next {
    pub fn after(batch: &[Received]) -> Next {
        let mut next = Next::default();
        for m in batch {
            let e = next.0.entry(m.partition).or_insert(0);
            *e = (*e).max(m.offset + 1);
        }
        next
    }

    /// Takes in later messages' offsets: each partition's furthest.
    pub fn merge(&mut self, later: Next) {
        for (p, o) in later.0 {
            let e = self.0.entry(p).or_insert(0);
            *e = (*e).max(o);
        }
    }
}

/// What the broker gathers before it answers a fetch, unless the fetch's
/// wait runs out first: about 200 transitions. With librdkafka's default of
/// one byte, a broker under a steady stream of votes answers a fetch as soon
/// as a transition arrives, so the consumer fetched about as often as the
/// votes were produced (BENCHMARKS.md, section 19).
const FETCH_MIN_BYTES: usize = 64 * 1024;

/// A member of the consumer group on the transitions topic.
#[derive(Clone)]
pub struct Source {
    consumer: Arc<StreamConsumer>,
    topic: String,
}

impl Source {
    /// Joins `group` and subscribes to the transitions topic, reading from
    /// the earliest offset when the group has committed none. The broker
    /// holds a fetch for up to `fetch_wait` (the consumer's own wait for a
    /// batch to fill) until it has `FETCH_MIN_BYTES` to send: at least 10 ms,
    /// since an idle broker answers a fetch with no wait at once and the
    /// consumer would ask again without pause, and at most librdkafka's
    /// default of 500 ms, which stays clear of its socket timeout.
    pub fn join(config: &KafkaConfig, group: &str, fetch_wait: Duration) -> anyhow::Result<Source> {
        let consumer: StreamConsumer = config
            .client()
            .set("group.id", group)
            .set("enable.auto.commit", "true")
            .set("auto.commit.interval.ms", "1000")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", "10000")
            .set("heartbeat.interval.ms", "1000")
            .set(
                "fetch.wait.max.ms",
                fetch_wait
                    .clamp(Duration::from_millis(10), Duration::from_millis(500))
                    .as_millis()
                    .to_string(),
            )
            .set("fetch.min.bytes", FETCH_MIN_BYTES.to_string())
            .create()
            .context("Failed to create the Kafka consumer")?;
        consumer
            .subscribe(&[&config.topic])
            .context("Failed to subscribe")?;
        Ok(Source {
            consumer: Arc::new(consumer),
            topic: config.topic.clone(),
        })
    }

    /// Waits for a first message, then takes more until the batch holds
    /// `max` or `wait` has passed since the first.
    pub async fn gather(&self, max: u64, wait: Duration) -> Vec<Received> {
        let mut batch = Vec::new();
        let mut stream = self.consumer.stream();
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
                Some(Ok(m)) => batch.push(Received::from_kafka(&m)),
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

    /// Stores these offsets. Offsets of partitions revoked meanwhile are
    /// refused; their new owner replays those messages, which the apply
    /// rule makes harmless.
    pub fn store(&self, next: &Next) {
        let mut tpl = TopicPartitionList::new();
        for (&p, &o) in &next.0 {
            if let Err(e) = tpl.add_partition_offset(&self.topic, p, Offset::Offset(o)) {
                tracing::warn!(partition = p, error = %e, "offset not stored; it will be replayed");
            }
        }
        if let Err(e) = self.consumer.store_offsets(&tpl) {
            tracing::info!(error = %e, "some offsets not stored (partition revoked?); they will be replayed");
        }
    }

    /// Commits what was stored and leaves the group, giving up after
    /// `bound`. librdkafka's synchronous commit and its close wait with no
    /// limit of their own for a coordinator that may never answer (a broker
    /// frozen or gone), so they run on a blocking thread, and a stop is
    /// never held by them for longer than `bound`. What the commit did not
    /// reach is replayed by the partitions' next owner, and the apply rule
    /// drops the replay.
    pub async fn leave(self, bound: Duration) {
        let leaving = tokio::task::spawn_blocking(move || {
            if let Err(e) = self.consumer.commit_consumer_state(CommitMode::Sync) {
                tracing::debug!(error = %e, "final commit had nothing to do or failed");
            }
            self.consumer.unsubscribe();
            // The last handle closes the consumer here, off the runtime.
            drop(self);
        });
        if tokio::time::timeout(bound, leaving).await.is_err() {
            tracing::warn!(
                bound = %humantime::format_duration(bound),
                "Kafka did not take the final commit or the leave in time; the uncommitted messages will be replayed and dropped as replays"
            );
        }
    }

    /// The lag of every partition assigned to this member. Blocking: call it
    /// from `spawn_blocking`.
    pub fn lag(&self, positions: &Positions) -> Vec<PartitionLag> {
        super::lag::measure(&self.consumer, &self.topic, positions)
    }
}
