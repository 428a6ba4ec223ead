//! Publishes committed transitions, keyed by target id so one target's
//! transitions stay in one partition, in commit order per user.

use std::time::Duration;

use anyhow::Context;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;

use super::KafkaConfig;
use crate::domain::Transition;

/// Header carrying the id of the HTTP request that caused a message.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

#[derive(Clone)]
pub struct Publisher {
    producer: FutureProducer,
    topic: String,
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
            .set("linger.ms", "2")
            .set(
                "message.timeout.ms",
                delivery_timeout.as_millis().max(1).to_string(),
            )
            .create()
            .context("Failed to create the Kafka producer")?;
        Ok(Publisher {
            producer,
            topic: config.topic.clone(),
        })
    }

    /// Sends one transition and waits for its delivery report.
    pub async fn publish(&self, transition: &Transition, request_id: &str) -> anyhow::Result<()> {
        let payload = transition
            .to_json()
            .context("Failed to encode the transition")?;
        let headers = OwnedHeaders::new().insert(Header {
            key: REQUEST_ID_HEADER,
            value: Some(request_id),
        });
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
