//! Consumer lag: per partition, how many messages and how many seconds the
//! consumer is behind the newest event. The largest is published to Redis,
//! where the vote API reads it to keep cache entries alive longer than it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::OwnedMessage;
use tokio::sync::watch;

use crate::cache::Cache;

/// How often lag is measured and published.
pub const INTERVAL: Duration = Duration::from_secs(5);

/// Per partition: the next offset to process and the timestamp (ms) of the
/// last processed message.
#[derive(Clone, Default)]
pub struct Positions(Arc<Mutex<HashMap<i32, (i64, i64)>>>);

impl Positions {
    pub fn advance(&self, batch: &[OwnedMessage]) {
        let Ok(mut map) = self.0.lock() else { return };
        for m in batch {
            let ts = m.timestamp().to_millis().unwrap_or_else(now_ms);
            let e = map.entry(m.partition()).or_insert((0, ts));
            if m.offset() + 1 > e.0 {
                *e = (m.offset() + 1, ts);
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
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// Measures the lag of every assigned partition. A partition with messages
/// waiting is as many seconds behind as its last processed message is old;
/// one never processed counts from its committed offset, with unknown age.
pub fn measure(consumer: &StreamConsumer, topic: &str, positions: &Positions) -> Vec<PartitionLag> {
    let Ok(assignment) = consumer.assignment() else { return Vec::new() };
    let committed = consumer.committed(Duration::from_secs(2)).ok();
    let mut out = Vec::new();
    for elem in assignment.elements_for_topic(topic) {
        let p = elem.partition();
        let Ok((low, high)) = consumer.fetch_watermarks(topic, p, Duration::from_secs(2)) else { continue };
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
        out.push(PartitionLag { partition: p, messages, seconds });
    }
    out
}

/// Measures lag every `INTERVAL`, logs it, and publishes the largest to Redis.
pub async fn report(consumer: Arc<StreamConsumer>, topic: String, positions: Positions, cache: Cache, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(INTERVAL);
    let mut n: u64 = 0;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let (c, t, p) = (consumer.clone(), topic.clone(), positions.clone());
        let Ok(lags) = tokio::task::spawn_blocking(move || measure(&c, &t, &p)).await else { continue };
        let worst = lags.iter().map(|l| l.seconds).fold(0.0, f64::max);
        let behind: i64 = lags.iter().map(|l| l.messages).sum();
        if let Err(e) = cache.publish_lag(worst, INTERVAL * 6).await {
            tracing::debug!(error = %e, "could not publish consumer lag");
        }
        n += 1;
        if n % 6 == 1 || behind > 0 {
            tracing::info!(messages_behind = behind, seconds_behind = worst, partitions = lags.len(), "consumer lag");
        }
    }
}
