//! The dead-letter topic: events the consumer cannot apply, with the reason
//! and where they came from in headers.

use std::time::Duration;

use anyhow::Context;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;

use super::KafkaConfig;
use super::source::Received;

/// Headers a dead letter carries.
pub const REASON_HEADER: &str = "tally-dlq-reason";
pub const SOURCE_TOPIC_HEADER: &str = "tally-source-topic";
pub const SOURCE_PARTITION_HEADER: &str = "tally-source-partition";
pub const SOURCE_OFFSET_HEADER: &str = "tally-source-offset";

pub struct DeadLetters {
    producer: FutureProducer,
    topic: String,
}

impl DeadLetters {
    pub fn new(config: &KafkaConfig) -> anyhow::Result<DeadLetters> {
        let producer = config
            .client()
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .create()
            .context("Failed to create the dead-letter producer")?;
        Ok(DeadLetters {
            producer,
            topic: config.dead_letter_topic.clone(),
        })
    }

    /// Sends one message with its reason and waits until Kafka has it.
    pub async fn send(&self, m: &Received, reason: &str) -> anyhow::Result<()> {
        let (partition, offset) = (m.partition.to_string(), m.offset.to_string());
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: REASON_HEADER,
                value: Some(reason),
            })
            .insert(Header {
                key: SOURCE_TOPIC_HEADER,
                value: Some(&m.topic),
            })
            .insert(Header {
                key: SOURCE_PARTITION_HEADER,
                value: Some(&partition),
            })
            .insert(Header {
                key: SOURCE_OFFSET_HEADER,
                value: Some(&offset),
            });
        let mut record = FutureRecord::to(&self.topic)
            .payload(&m.payload)
            .headers(headers);
        if let Some(key) = &m.key {
            record = record.key(key);
        }
        self.producer
            .send(record, Timeout::After(Duration::from_secs(5)))
            .await
            .map(|_| ())
            .map_err(|(e, _)| anyhow::Error::new(e).context("Kafka did not take the dead letter"))
    }
}
