//! Consumer lag: per partition, how many messages and how many seconds the
//! consumer is behind the newest event. The consumer measures its own (from
//! what it processed, through `Source::lag`); the vote API measures the
//! group's from outside (`group_lag`, from committed offsets), exports it,
//! and keeps cache entries alive longer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};

use super::source::Received;

/// How often lag is measured and published.
pub const INTERVAL: Duration = Duration::from_secs(5);

/// Per partition: the next offset to process and the timestamp (ms) of the
/// last processed message.
#[derive(Clone, Default)]
pub struct Positions(Arc<Mutex<HashMap<i32, (i64, i64)>>>);

impl Positions {
    pub fn advance(&self, batch: &[Received]) {
        let Ok(mut map) = self.0.lock() else { return };
        for m in batch {
            let ts = m.timestamp_ms.unwrap_or_else(now_ms);
            let e = map.entry(m.partition).or_insert((0, ts));
            if m.offset + 1 > e.0 {
                *e = (m.offset + 1, ts);
            }
        }
    }

    fn get(&self, partition: i32) -> Option<(i64, i64)> {
        self.0.lock().ok().and_then(|m| m.get(&partition).copied())
    }
}

/// One partition's lag.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PartitionLag {
    pub partition: i32,
    pub messages: i64,
    pub seconds: f64,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Measures the lag of every assigned partition. A partition with messages
/// waiting is as many seconds behind as its last processed message is old;
/// one never processed counts from its committed offset, with unknown age.
pub(super) fn measure(
    consumer: &StreamConsumer,
    topic: &str,
    positions: &Positions,
) -> Vec<PartitionLag> {
    let Ok(assignment) = consumer.assignment() else {
        return Vec::new();
    };
    let committed = consumer.committed(Duration::from_secs(2)).ok();
    let mut out = Vec::new();
    for elem in assignment.elements_for_topic(topic) {
        let p = elem.partition();
        let Ok((low, high)) = consumer.fetch_watermarks(topic, p, Duration::from_secs(2)) else {
            continue;
        };
        let (next, seconds_source) = match positions.get(p) {
            Some((next, ts)) => (next, Some(ts)),
            None => {
                let from_commit = committed
                    .as_ref()
                    .and_then(|c| c.find_partition(topic, p))
                    .and_then(|e| e.offset().to_raw())
                    .filter(|o| *o >= 0);
                (from_commit.unwrap_or(low), None)
            }
        };
        let messages = (high - next).max(0);
        let seconds = match (messages, seconds_source) {
            (0, _) => 0.0,
            (_, Some(ts)) => ((now_ms() - ts).max(0) as f64) / 1000.0,
            (_, None) => 0.0,
        };
        out.push(PartitionLag {
            partition: p,
            messages,
            seconds,
        });
    }
    out
}

/// The group's lag as seen from outside the consumer, from its committed
/// offsets: what the vote API exports and sizes the cache TTL by. It keeps
/// rising while every consumer is down, which is when it matters most.
pub fn group_lag(kafka: &super::KafkaConfig, group: &str) -> anyhow::Result<Vec<PartitionLag>> {
    use anyhow::Context;
    use rdkafka::TopicPartitionList;
    use rdkafka::consumer::BaseConsumer;

    let observer: BaseConsumer = kafka
        .client()
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        // It reads one message per lagging partition, for its timestamp.
        // librdkafka's defaults would fetch and parse up to a megabyte of
        // each, every INTERVAL, just when the consumer is behind and the
        // API busiest: a fifth of `tally vote`'s instructions per vote
        // then (BENCHMARKS.md section 13). Kafka still answers a fetch with at
        // least the first record batch, however small these are.
        // (librdkafka wants message.max.bytes <= fetch.max.bytes; 1000 is
        // its least, and this client sends nothing.)
        .set("message.max.bytes", "1000")
        .set("fetch.max.bytes", "1000")
        .set("max.partition.fetch.bytes", "1000")
        .set("queued.min.messages", "1")
        .create()
        .context("Failed to create the lag observer")?;
    let metadata = observer
        .fetch_metadata(Some(&kafka.topic), Duration::from_secs(2))
        .context("no topic metadata")?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    let mut tpl = TopicPartitionList::new();
    for p in &partitions {
        tpl.add_partition(&kafka.topic, *p);
    }
    let committed = observer
        .committed_offsets(tpl, Duration::from_secs(2))
        .context("no committed offsets")?;
    let mut out = Vec::new();
    for p in partitions {
        let (low, high) = observer
            .fetch_watermarks(&kafka.topic, p, Duration::from_secs(2))
            .context("no watermarks")?;
        let next = committed
            .find_partition(&kafka.topic, p)
            .and_then(|e| e.offset().to_raw())
            .filter(|o| *o >= 0)
            .unwrap_or(low);
        let messages = (high - next).max(0);
        let seconds = if messages > 0 {
            oldest_age(&observer, &kafka.topic, p, next).unwrap_or(0.0)
        } else {
            0.0
        };
        out.push(PartitionLag {
            partition: p,
            messages,
            seconds,
        });
    }
    Ok(out)
}

/// How old the message at `offset` is: the oldest one not yet processed.
fn oldest_age(
    observer: &rdkafka::consumer::BaseConsumer,
    topic: &str,
    partition: i32,
    offset: i64,
) -> Option<f64> {
    use rdkafka::{Offset, TopicPartitionList};
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(offset))
        .ok()?;
    observer.assign(&tpl).ok()?;
    let message = observer.poll(Duration::from_secs(2))?.ok()?;
    let ts = message.timestamp().to_millis()?;
    Some(((now_ms() - ts).max(0) as f64) / 1000.0)
}
