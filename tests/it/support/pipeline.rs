//! The consumer running in-process, and the transitions topic as the tests
//! read and write it directly.

use std::time::Duration;

use super::{TEST_PARTITIONS, TestEnv};

/// A consumer running in-process.
pub struct RunningConsumer {
    stop: tokio::sync::watch::Sender<bool>,
    pub progress: std::sync::Arc<tally::consumer::Progress>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl RunningConsumer {
    pub fn processed(&self) -> u64 {
        self.progress
            .processed
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stops it the way SIGTERM does, and waits for it to leave the group.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        match tokio::time::timeout(Duration::from_secs(60), self.task).await {
            Ok(Ok(Ok(()))) => {}
            other => panic!("consumer did not stop cleanly: {other:?}"),
        }
    }
}

impl TestEnv {
    /// Waits until this test's consumer group has counted everything on its
    /// topic (its lag is 0 on every partition), for at most `within`.
    pub async fn until_drained(&self, within: Duration) {
        super::eventually("the consumer to drain", within, || async {
            let lag = tokio::task::spawn_blocking({
                let (k, g) = (self.kafka.clone(), self.group.clone());
                move || tally::bus::lag::group_lag(&k, &g)
            })
            .await
            .ok()?
            .ok()?;
            lag.iter().all(|l| l.messages == 0).then_some(())
        })
        .await;
    }

    /// Every outbox intent of this test's keyspace, by its key, with whether
    /// it is marked resolved; `None` while Cassandra does not answer.
    pub async fn intents(&self) -> Option<Vec<(String, Option<bool>)>> {
        Some(
            self.session
                .query_unpaged("SELECT idem_key, resolved FROM outbox_intents", ())
                .await
                .ok()?
                .into_rows_result()
                .ok()?
                .rows::<(String, Option<bool>)>()
                .ok()?
                .filter_map(Result::ok)
                .collect(),
        )
    }

    pub fn consumer_config(&self) -> tally::consumer::ConsumerConfig {
        tally::consumer::ConsumerConfig {
            group: self.group.clone(),
            batch_max: 200,
            batch_wait: Duration::from_millis(20),
            parallelism: 8,
            drain_timeout: Duration::from_secs(20),
            mode: tally::consumer::WriteMode::Batched,
            park_after: 8,
            trust_events: false,
            cache_ttl: tally::cache::TtlPolicy {
                min: Duration::from_secs(60),
                max: Duration::from_secs(3600),
            },
            listen: "127.0.0.1:0".into(),
            stores: self.stores(),
        }
    }

    pub fn start_consumer(&self) -> RunningConsumer {
        self.start_consumer_with(self.consumer_config())
    }

    /// A consumer that counts events without checking them against the
    /// users' rows (`--trust-events`): for tests that publish events of
    /// their own, with no rows behind them.
    pub fn start_consumer_trusting(&self) -> RunningConsumer {
        self.start_consumer_with(tally::consumer::ConsumerConfig {
            trust_events: true,
            ..self.consumer_config()
        })
    }

    pub fn start_consumer_with(&self, config: tally::consumer::ConsumerConfig) -> RunningConsumer {
        let (stop, rx) = tokio::sync::watch::channel(false);
        let progress = std::sync::Arc::new(tally::consumer::Progress::default());
        let task = tokio::spawn(tally::consumer::run(config, rx, progress.clone()));
        RunningConsumer {
            stop,
            progress,
            task,
        }
    }

    /// Publishes raw bytes to the transitions topic, keyed like the API does.
    pub async fn publish_raw(&self, key: &str, payload: &[u8]) {
        self.publish_raw_signed(key, payload, None).await;
    }

    /// The same, with `signature` in the header the API signs in.
    pub async fn publish_raw_signed(&self, key: &str, payload: &[u8], signature: Option<&str>) {
        use rdkafka::message::{Header, OwnedHeaders};
        use rdkafka::producer::{FutureProducer, FutureRecord};
        let producer: FutureProducer = self
            .kafka
            .client()
            .create()
            .unwrap_or_else(|e| panic!("{e}"));
        let mut record = FutureRecord::to(&self.kafka.topic)
            .key(key)
            .payload(payload);
        if let Some(signature) = signature {
            record = record.headers(OwnedHeaders::new().insert(Header {
                key: tally::bus::signature::HEADER,
                value: Some(signature),
            }));
        }
        producer
            .send(record, Duration::from_secs(10))
            .await
            .unwrap_or_else(|(e, _)| panic!("{e}"));
    }

    pub async fn publish_transition(
        &self,
        user: &str,
        target: &str,
        from: &str,
        to: &str,
        version: i64,
    ) {
        let t = serde_json::json!({
            "target_id": target, "target_type": "video", "user_id": user,
            "from": from, "to": to, "version": version, "occurred_at": "2026-11-29T00:00:00.000Z"
        });
        self.publish_raw(target, t.to_string().as_bytes()).await;
    }

    /// How many messages the transitions topic holds (sum of high
    /// watermarks). The API answers only after Kafka acknowledged, so once a
    /// response is in, this count is final: no waiting needed to see that
    /// nothing was published.
    pub fn published(&self) -> i64 {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let consumer: BaseConsumer = self
            .kafka
            .client()
            .create()
            .unwrap_or_else(|e| panic!("{e}"));
        (0..TEST_PARTITIONS)
            .map(|p| {
                let (_, high) = consumer
                    .fetch_watermarks(&self.kafka.topic, p, Duration::from_secs(10))
                    .unwrap_or_else(|e| panic!("watermarks: {e}"));
                high
            })
            .sum()
    }

    /// Every transition on the topic, in partition order.
    pub async fn transitions(&self) -> Vec<tally::domain::Transition> {
        self.messages()
            .await
            .into_iter()
            .map(|(payload, _)| {
                tally::domain::Transition::from_json(&payload)
                    .unwrap_or_else(|e| panic!("bad event on the topic: {e}"))
            })
            .collect()
    }

    /// Every message on the topic, in partition order: its payload and its
    /// signature header, if it has one.
    pub async fn messages(&self) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        use rdkafka::message::Headers;
        use rdkafka::{Message, Offset, TopicPartitionList};
        let expected = self.published();
        let consumer: BaseConsumer = self
            .kafka
            .client()
            .set(
                "group.id",
                format!("{}-reader-{}", self.group, uuid::Uuid::new_v4().simple()),
            )
            .set("enable.auto.commit", "false")
            .create()
            .unwrap_or_else(|e| panic!("{e}"));
        let mut tpl = TopicPartitionList::new();
        for p in 0..TEST_PARTITIONS {
            tpl.add_partition_offset(&self.kafka.topic, p, Offset::Beginning)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        consumer.assign(&tpl).unwrap_or_else(|e| panic!("{e}"));
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut out = Vec::new();
        while (out.len() as i64) < expected {
            assert!(
                std::time::Instant::now() < deadline,
                "read {} of {expected} transitions",
                out.len()
            );
            if let Some(msg) = consumer.poll(Duration::from_millis(200)) {
                let msg = msg.unwrap_or_else(|e| panic!("{e}"));
                let signature = msg.headers().and_then(|h| {
                    h.iter()
                        .find(|h| h.key == tally::bus::signature::HEADER)
                        .and_then(|h| h.value.map(<[u8]>::to_vec))
                });
                out.push((msg.payload().unwrap_or_default().to_vec(), signature));
            }
        }
        out
    }
}
