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
/// On a dead letter whose payload was cut: the payload's whole length and
/// its SHA-256 (hex).
pub const ORIGINAL_BYTES_HEADER: &str = "tally-dlq-original-bytes";
pub const ORIGINAL_SHA256_HEADER: &str = "tally-dlq-original-sha256";
/// The same for a key that was cut.
pub const ORIGINAL_KEY_BYTES_HEADER: &str = "tally-dlq-original-key-bytes";

/// The most of a payload a dead letter carries. A transition is a few
/// hundred bytes; a message near the transitions topic's limit could never
/// be sent whole with headers added (librdkafka refuses a message over its
/// own 1,000,000 bytes, the topic one over its limit), and the consumer
/// would stop at it for good, since an event is never skipped.
pub const KEPT_PAYLOAD: usize = 64 * 1024;
/// The most of a key a dead letter carries (tally's keys are target ids).
pub const KEPT_KEY: usize = 1024;
/// The most of a reason a dead letter carries: a parse error quotes the
/// value it refused, which can be as long as the payload.
pub const KEPT_REASON: usize = 4096;

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

    /// Sends one message with its reason and waits until Kafka has it. A
    /// payload or key longer than it keeps is cut, with the whole length
    /// (and for the payload its SHA-256) in headers.
    pub async fn send(&self, m: &Received, reason: &str) -> anyhow::Result<()> {
        let (partition, offset) = (m.partition.to_string(), m.offset.to_string());
        let reason = cut_reason(reason);
        let mut headers = OwnedHeaders::new()
            .insert(Header {
                key: REASON_HEADER,
                value: Some(reason.as_ref()),
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
        let payload = &m.payload[..m.payload.len().min(KEPT_PAYLOAD)];
        if payload.len() < m.payload.len() {
            let (bytes, sha) = (m.payload.len().to_string(), sha256_hex(&m.payload));
            headers = headers
                .insert(Header {
                    key: ORIGINAL_BYTES_HEADER,
                    value: Some(&bytes),
                })
                .insert(Header {
                    key: ORIGINAL_SHA256_HEADER,
                    value: Some(&sha),
                });
        }
        let key = m.key.as_deref().map(|k| {
            let kept = &k[..k.len().min(KEPT_KEY)];
            (kept, (kept.len() < k.len()).then(|| k.len().to_string()))
        });
        if let Some((_, Some(bytes))) = &key {
            headers = headers.insert(Header {
                key: ORIGINAL_KEY_BYTES_HEADER,
                value: Some(bytes),
            });
        }
        let mut record = FutureRecord::to(&self.topic)
            .payload(payload)
            .headers(headers);
        if let Some((key, _)) = key {
            record = record.key(key);
        }
        self.producer
            .send(record, Timeout::After(Duration::from_secs(5)))
            .await
            .map(|_| ())
            .map_err(|(e, _)| anyhow::Error::new(e).context("Kafka did not take the dead letter"))
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

/// `reason`, or its first `KEPT_REASON` bytes (at a character's edge) and
/// how long it was.
fn cut_reason(reason: &str) -> std::borrow::Cow<'_, str> {
    if reason.len() <= KEPT_REASON {
        return reason.into();
    }
    let mut end = KEPT_REASON;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{} ... (cut from {} bytes)", &reason[..end], reason.len()).into()
}

#[cfg(test)]
mod tests {
    use super::{KEPT_REASON, cut_reason};

    #[test]
    fn a_long_reason_is_cut_at_a_character_edge_and_says_so() {
        assert_eq!(cut_reason("short"), "short");
        let long = format!("a{}", "é".repeat(KEPT_REASON));
        let cut = cut_reason(&long);
        assert!(cut.len() < KEPT_REASON + 40, "{}", cut.len());
        assert!(cut.starts_with("aé"));
        assert!(cut.ends_with(&format!(" ... (cut from {} bytes)", long.len())));
    }
}
