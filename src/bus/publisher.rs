//! Publishes committed transitions, keyed by target id so one target's
//! transitions stay in one partition, in commit order per user.

use std::time::Duration;

use anyhow::Context;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;

use super::KafkaConfig;
use super::signature::{self, EventKey};
use crate::domain::Transition;

/// Header carrying the id of the HTTP request that caused a message.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// How long the producer holds a transition to send it with the others of
/// those milliseconds. Under load it puts several votes in one produce
/// request: with 2 ms a vote was a request of its own or nearly, and with
/// the consumer's fetches (`bus::source`) that cost the broker about a third
/// more CPU per vote (BENCHMARKS.md, section 19). The answer does not wait
/// for it (`--publish-wait 0s`).
pub const LINGER: Duration = Duration::from_millis(10);

/// The shortest publish timeout: librdkafka refuses one that is not longer
/// than the linger, and one barely longer would fail most publishes.
pub const SHORTEST_TIMEOUT: Duration = Duration::from_millis(50);

#[derive(Clone)]
pub struct Publisher {
    producer: FutureProducer,
    topic: String,
    key: Option<EventKey>,
}

impl Publisher {
    /// An idempotent producer with acks=all: a delivery report means every
    /// in-sync replica has the event, and librdkafka's own retries cannot
    /// duplicate or reorder it.
    pub fn new(config: &KafkaConfig, delivery_timeout: Duration) -> anyhow::Result<Publisher> {
        let producer: FutureProducer = config
            .client()
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", LINGER.as_millis().to_string())
            .set(
                "message.timeout.ms",
                delivery_timeout.as_millis().max(1).to_string(),
            )
            .create()
            .context("Failed to create the Kafka producer")?;
        Ok(Publisher {
            producer,
            topic: config.topic.clone(),
            key: config.event_key().map_err(anyhow::Error::msg)?,
        })
    }

    /// Sends one transition and waits for its delivery report.
    pub async fn publish(&self, transition: &Transition, request_id: &str) -> anyhow::Result<()> {
        let payload = transition
            .to_json()
            .context("Failed to encode the transition")?;
        let mut headers = OwnedHeaders::new().insert(Header {
            key: REQUEST_ID_HEADER,
            value: Some(request_id),
        });
        if let Some(key) = &self.key {
            headers = headers.insert(Header {
                key: signature::HEADER,
                value: Some(&key.sign(&payload)),
            });
        }
        let record = FutureRecord::to(&self.topic)
            .key(transition.target_id.as_str())
            .payload(&payload)
            .headers(headers);
        self.producer
            .send(record, Timeout::After(Duration::from_secs(1)))
            .await
            .map(|_| ())
            .map_err(|(e, _)| anyhow::anyhow!("Kafka did not take the transition: {e}"))
    }
}
