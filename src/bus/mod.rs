//! The only code that speaks Kafka: topic administration (`admin`), the
//! transition publisher (`publisher`), the consumer's group member
//! (`source`), the dead-letter topic (`dead_letter`) and lag (`lag`).

pub mod admin;
pub mod dead_letter;
pub mod lag;
pub mod publisher;
pub mod signature;
pub mod source;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, Producer};

use crate::secret::Secret;
use signature::EventKey;

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

    /// How tally authenticates to the brokers: `plaintext` (nothing, for a
    /// local stack), `ssl` (TLS), or `sasl-ssl` (SASL/SCRAM over TLS).
    #[arg(long = "kafka-security", env = "TALLY_KAFKA_SECURITY", value_enum, default_value_t = KafkaSecurity::Plaintext)]
    pub security: KafkaSecurity,

    /// SASL user (with `--kafka-security sasl-ssl`).
    #[arg(
        long = "kafka-user",
        id = "kafka_user",
        value_name = "USER",
        env = "TALLY_KAFKA_USER",
        requires = "kafka_password"
    )]
    pub user: Option<String>,

    /// That user's password.
    #[arg(
        long = "kafka-password",
        id = "kafka_password",
        value_name = "PASSWORD",
        env = "TALLY_KAFKA_PASSWORD",
        hide_env_values = true,
        requires = "kafka_user"
    )]
    pub password: Option<Secret>,

    /// The SASL mechanism.
    #[arg(long = "kafka-sasl-mechanism", env = "TALLY_KAFKA_SASL_MECHANISM", default_value = "SCRAM-SHA-512", value_parser = ["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"])]
    pub sasl_mechanism: String,

    /// Trust the certificate authorities in this PEM file (else the
    /// system's); each broker's certificate must name its address.
    #[arg(
        long = "kafka-tls-ca",
        id = "kafka_tls_ca",
        value_name = "FILE",
        env = "TALLY_KAFKA_TLS_CA"
    )]
    pub tls_ca: Option<PathBuf>,

    /// HMAC-SHA256 key (at least 32 bytes) the vote API signs the
    /// transitions it publishes with, and the consumer verifies them with:
    /// an event whose signature verifies is counted without reading the
    /// user's row behind it. Give both the same key. An event unsigned or
    /// not signed with it is read against the rows, as with no key at all.
    /// Never printed.
    #[arg(
        long = "event-signing-key",
        value_name = "KEY",
        env = "TALLY_EVENT_SIGNING_KEY",
        hide_env_values = true
    )]
    pub event_signing_key: Option<Secret>,
}

/// See `--kafka-security`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum KafkaSecurity {
    Plaintext,
    Ssl,
    SaslSsl,
}

impl KafkaConfig {
    pub fn local(topic: &str) -> KafkaConfig {
        KafkaConfig {
            brokers: "127.0.0.1:9092".into(),
            topic: topic.into(),
            dead_letter_topic: format!("{topic}.dlq"),
            security: KafkaSecurity::Plaintext,
            user: None,
            password: None,
            sasl_mechanism: "SCRAM-SHA-512".into(),
            tls_ca: None,
            event_signing_key: None,
        }
    }

    /// The event signing key, if one is given; a key too short is refused
    /// (without printing it).
    pub fn event_key(&self) -> Result<Option<EventKey>, String> {
        self.event_signing_key
            .as_ref()
            .map(EventKey::new)
            .transpose()
    }

    /// The settings every client shares.
    pub fn client(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers);
        let protocol = match self.security {
            KafkaSecurity::Plaintext => "plaintext",
            KafkaSecurity::Ssl => "ssl",
            KafkaSecurity::SaslSsl => "sasl_ssl",
        };
        c.set("security.protocol", protocol);
        if self.security == KafkaSecurity::SaslSsl {
            c.set("sasl.mechanisms", &self.sasl_mechanism);
            if let (Some(user), Some(password)) = (&self.user, &self.password) {
                c.set("sasl.username", user);
                c.set("sasl.password", password.expose());
            }
        }
        if let Some(ca) = &self.tls_ca {
            c.set("ssl.ca.location", ca.to_string_lossy());
        }
        c
    }
}

/// Records whether the brokers refused the client's login: librdkafka
/// retries a refused SASL login forever and reports it only here.
#[derive(Default)]
struct LoginWatch(std::sync::Mutex<Option<String>>);

impl rdkafka::ClientContext for LoginWatch {
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        use rdkafka::types::RDKafkaErrorCode;
        let refused = matches!(
            error.rdkafka_error_code(),
            Some(
                RDKafkaErrorCode::Authentication
                    | RDKafkaErrorCode::SaslAuthenticationFailed
                    | RDKafkaErrorCode::SSL
            )
        );
        if refused && let Ok(mut seen) = self.0.lock() {
            *seen = Some(reason.to_owned());
        }
    }
}

impl rdkafka::consumer::ConsumerContext for LoginWatch {}

/// What one attempt to reach the brokers found.
#[derive(Debug)]
pub enum Reach {
    Answered,
    /// They answered, and refused the login or the TLS handshake: a
    /// setting is wrong, and trying again will not help.
    Refused(String),
    /// No answer within the time given (down, or unreachable).
    Silent,
}

impl KafkaConfig {
    /// Asks the brokers for their metadata, for up to `within`, telling a
    /// refused login from no answer.
    pub async fn reach(&self, within: Duration) -> anyhow::Result<Reach> {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let client: BaseConsumer<LoginWatch> = self
            .client()
            .create_with_context(LoginWatch::default())
            .context("Failed to create a Kafka client")?;
        tokio::task::spawn_blocking(move || {
            let deadline = std::time::Instant::now() + within;
            loop {
                if client
                    .fetch_metadata(None, Duration::from_millis(500))
                    .is_ok()
                {
                    return Reach::Answered;
                }
                // Serves the error callbacks, where a refused login shows.
                let _ = client.poll(Duration::from_millis(100));
                if let Some(reason) = client.context().0.lock().ok().and_then(|r| r.clone()) {
                    return Reach::Refused(reason);
                }
                if std::time::Instant::now() >= deadline {
                    return Reach::Silent;
                }
            }
        })
        .await
        .context("the Kafka check did not run")
    }

    /// Fails when the brokers refuse tally's login; no answer is only
    /// reported, for roles that work through a Kafka outage.
    pub async fn check_login(&self) -> anyhow::Result<()> {
        match self.reach(Duration::from_secs(5)).await? {
            Reach::Answered => Ok(()),
            Reach::Refused(reason) => Err(anyhow::anyhow!(
                "Kafka at {} refused the login{} or the TLS settings: {reason}",
                self.brokers,
                self.user
                    .as_ref()
                    .map(|u| format!(" as {u}"))
                    .unwrap_or_default()
            )),
            Reach::Silent => {
                tracing::warn!(brokers = %self.brokers, "Kafka does not answer yet; going on without it");
                Ok(())
            }
        }
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
