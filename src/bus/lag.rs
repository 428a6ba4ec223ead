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
        let committed_at = committed
            .as_ref()
            .and_then(|c| c.find_partition(topic, p))
            .and_then(|e| e.offset().to_raw())
            .filter(|o| *o >= 0);
        let (messages, seconds) = behind(positions.get(p), committed_at, (low, high), now_ms());
        out.push(PartitionLag {
            partition: p,
            messages,
            seconds,
        });
    }
    out
}

/// How far one partition is behind its high watermark: in messages, and in
/// seconds since the last message processed, when there are some waiting.
/// A position older than the group's committed offset is another member's
/// work since (the partition went away in a rebalance and came back): the
/// committed offset is then where this member stands, of unknown age, as
/// for a partition it never processed.
fn behind(
    position: Option<(i64, i64)>,
    committed: Option<i64>,
    (low, high): (i64, i64),
    now_ms: i64,
) -> (i64, f64) {
    let (next, last_ms) = match (position, committed) {
        (Some((next, _)), Some(c)) if c > next => (c, None),
        (Some((next, ts)), _) => (next, Some(ts)),
        (None, c) => (c.unwrap_or(low), None),
    };
    let messages = (high - next).max(0);
    let seconds = match (messages, last_ms) {
        (0, _) | (_, None) => 0.0,
        (_, Some(ts)) => ((now_ms - ts).max(0) as f64) / 1000.0,
    };
    (messages, seconds)
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

#[cfg(test)]
mod tests {
    use super::behind;

    #[test]
    fn a_position_another_member_has_gone_past_is_not_lag() {
        let now = 100_000;
        // Processed up to 1,000 a minute ago; another member took the
        // partition, counted to 5,000 and committed; it came back.
        assert_eq!(
            behind(Some((1_000, 40_000)), Some(5_000), (0, 5_000), now),
            (0, 0.0)
        );
        // Behind its own position, with messages waiting: aged from the last.
        assert_eq!(
            behind(Some((900, 40_000)), Some(800), (0, 1_000), now),
            (100, 60.0)
        );
        // Never processed here: from the committed offset, age unknown.
        assert_eq!(behind(None, Some(700), (0, 1_000), now), (300, 0.0));
        assert_eq!(behind(None, None, (200, 1_000), now), (800, 0.0));
    }
}
