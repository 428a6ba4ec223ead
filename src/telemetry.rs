//! Logging: human-readable on a terminal, JSON lines for machines. Logs go to
//! stderr so stdout stays clean for output meant for pipes (tokens, reports).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human on a terminal, JSON otherwise.
    Auto,
    Human,
    Json,
}

/// The filter without `RUST_LOG`: INFO, but only the access log lines that
/// must be seen (5xx, slow), since one line per request at a few thousand
/// requests a second is most of a core and hundreds of MB a minute.
pub const DEFAULT_FILTER: &str = "info,tally::access=warn";

/// Installs the global subscriber. `RUST_LOG` filters (default
/// `DEFAULT_FILTER`).
pub fn init(format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let json = match format {
        LogFormat::Json => true,
        LogFormat::Human => false,
        LogFormat::Auto => !std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // A second init (tests start many apps in one process) is harmless.
    let _ = if json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .try_init()
    } else {
        builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init()
    };
}
