//! Topic creation for `tally migrate`.

use std::time::Duration;

use anyhow::{Context, bail};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;

use super::KafkaConfig;

/// Creates the transitions and dead-letter topics if they do not exist.
/// Returns the names it created.
pub async fn ensure_topics(
    config: &KafkaConfig,
    partitions: i32,
    replication: i32,
) -> anyhow::Result<Vec<String>> {
    let admin: AdminClient<DefaultClientContext> = config
        .client()
        .create()
        .context("Failed to create a Kafka admin client")?;
    let topics = [
        NewTopic::new(
            &config.topic,
            partitions,
            TopicReplication::Fixed(replication),
        ),
        // The dead-letter topic is small and rarely read; one partition keeps it in order.
        NewTopic::new(
            &config.dead_letter_topic,
            1,
            TopicReplication::Fixed(replication),
        ),
    ];
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let results = admin
        .create_topics(&topics, &options)
        .await
        .context("Failed to create Kafka topics")?;
    let mut created = Vec::new();
    for result in results {
        match result {
            Ok(name) => created.push(name),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((name, code)) => bail!("Failed to create topic {name}: {code}"),
        }
    }
    Ok(created)
}

/// Deletes topics; used by tests to clean up after themselves.
pub async fn delete_topics(config: &KafkaConfig, names: &[&str]) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = config
        .client()
        .create()
        .context("Failed to create a Kafka admin client")?;
    admin
        .delete_topics(
            names,
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .context("Failed to delete topics")?;
    Ok(())
}
