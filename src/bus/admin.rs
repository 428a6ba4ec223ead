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
    // With acks=all, a write is acknowledged once this many replicas have
    // it: a majority, so one broker's loss neither loses an acknowledged
    // transition nor stops publication.
    let min_isr = min_insync_replicas(replication).to_string();
    let topics = [
        NewTopic::new(
            &config.topic,
            partitions,
            TopicReplication::Fixed(replication),
        )
        .set("min.insync.replicas", &min_isr),
        // The dead-letter topic is small and rarely read; one partition keeps it in order.
        NewTopic::new(
            &config.dead_letter_topic,
            1,
            TopicReplication::Fixed(replication),
        )
        .set("min.insync.replicas", &min_isr),
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

/// The broker id leading each partition of the transitions topic, and the
/// in-sync replicas of each: what an operator (or a fault test) needs to
/// know which broker a restart will move leadership away from.
pub fn partition_leaders(config: &KafkaConfig) -> anyhow::Result<Vec<(i32, i32, usize)>> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let client: BaseConsumer = config
        .client()
        .create()
        .context("Failed to create a Kafka metadata client")?;
    let metadata = client
        .fetch_metadata(Some(&config.topic), Duration::from_secs(5))
        .context("no topic metadata")?;
    Ok(metadata
        .topics()
        .iter()
        .flat_map(|t| t.partitions())
        .map(|p| (p.id(), p.leader(), p.isr().len()))
        .collect())
}

/// A majority of the replicas: 1 of 1, 2 of 3, 3 of 5.
pub fn min_insync_replicas(replication: i32) -> i32 {
    replication / 2 + 1
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

#[cfg(test)]
mod tests {
    use super::min_insync_replicas;

    #[test]
    fn min_insync_replicas_is_a_majority() {
        assert_eq!([1, 2, 3, 5].map(min_insync_replicas), [1, 2, 2, 3]);
    }
}
