//! The only code that speaks Kafka: topic administration, the transition
//! publisher and the consumer's client.

pub mod admin;
pub mod publisher;

use rdkafka::ClientConfig;

/// Where Kafka is and which topics tally uses.
#[derive(clap::Args, Debug, Clone)]
pub struct KafkaConfig {
    /// Kafka bootstrap servers, comma separated.
    #[arg(
        long = "kafka-brokers",
        env = "TALLY_KAFKA_BROKERS",
        default_value = "127.0.0.1:9092"
    )]
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
