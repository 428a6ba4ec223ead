//! The only code that speaks Kafka: topic administration (`admin`), the
//! transition publisher (`publisher`), the consumer's group member
//! (`source`), the dead-letter topic (`dead_letter`) and lag (`lag`).

pub mod admin;
pub mod dead_letter;
pub mod lag;
pub mod publisher;
pub mod source;

use std::time::Duration;

use anyhow::Context;
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, Producer};

/// Where Kafka is and which topics tally uses.
#[derive(clap::Args, Debug, Clone)]
pub struct KafkaConfig {
    /// Kafka bootstrap servers, comma separated.
    #[arg(long = "kafka-brokers", env = "TALLY_KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub brokers: String,

    /// Topic the vote API publishes transitions to, keyed by target id.
    #[arg(long, env = "TALLY_TOPIC", default_value = "vote-transitions")]
    pub topic: String,

    /// Topic for events the consumer cannot apply, with the reason in a header.
    #[arg(
        long = "dead-letter-topic",
        env = "TALLY_DEAD_LETTER_TOPIC",
        default_value = "vote-transitions.dlq"
    )]
    pub dead_letter_topic: String,
}

impl KafkaConfig {
    pub fn local(topic: &str) -> KafkaConfig {
        KafkaConfig {
            brokers: "127.0.0.1:9092".into(),
            topic: topic.into(),
            dead_letter_topic: format!("{topic}.dlq"),
        }
    }

    /// The settings every client shares.
    pub fn client(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers);
        c
    }
}

/// Asks Kafka for the transitions topic's metadata: the readiness check.
#[derive(Clone)]
pub struct Probe {
    client: FutureProducer,
    topic: String,
}

impl Probe {
    pub fn new(config: &KafkaConfig) -> anyhow::Result<Probe> {
        let client = config
            .client()
            .create()
            .context("Failed to create the Kafka readiness client")?;
        Ok(Probe {
            client,
            topic: config.topic.clone(),
        })
    }

    /// Whether the brokers answer and know the topic, within `timeout`.
    pub async fn check(&self, timeout: Duration) -> anyhow::Result<()> {
        let (client, topic) = (self.client.clone(), self.topic.clone());
        let n_topics = tokio::task::spawn_blocking(move || {
            client
                .client()
                .fetch_metadata(Some(&topic), timeout)
                .map(|m| m.topics().len())
        })
        .await
        .context("the Kafka check did not run")?
        .context("Kafka did not answer")?;
        anyhow::ensure!(n_topics > 0, "topic not found");
        Ok(())
    }
}
