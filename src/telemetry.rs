//! Logging: human-readable on a terminal, JSON lines for machines. Logs go to
//! stderr so stdout stays clean for output meant for pipes (tokens, reports).

use std::io::{IsTerminal, Write};

use tracing_subscriber::EnvFilter;

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human on a terminal, JSON otherwise.
    Auto,
    Human,
    Json,
}

/// The filter without `RUST_LOG`: INFO for tally, WARN for the libraries
/// (the Cassandra driver's INFO lines about nodes and sharding are noise to
/// an operator), and only the access log lines that must be seen (5xx,
/// slow), since one line per request at a few thousand requests a second is
/// most of a core and hundreds of MB a minute.
pub const DEFAULT_FILTER: &str = "warn,tally=info,tally::access=warn";

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
        .with_writer(AboveStatus);
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

/// The status line at the bottom of a terminal (a progress bar), if one is
/// shown: log lines are written above it, never into it.
static STATUS: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Shows `line` as the status line (on a terminal), replacing the last one.
pub fn show_status(line: &str) {
    if let Ok(mut status) = STATUS.lock() {
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[2K{line}");
        let _ = err.flush();
        *status = Some(line.to_owned());
    }
}

/// Leaves the last status line where it is and ends it.
pub fn end_status() {
    if let Ok(mut status) = STATUS.lock()
        && status.take().is_some()
    {
        eprintln!();
    }
}

/// Writes each log line to stderr whole, above the status line if one is
/// shown: the line is cleared, the log line written, the status drawn again.
struct AboveStatus;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for AboveStatus {
    type Writer = LogLine;

    fn make_writer(&'a self) -> LogLine {
        LogLine(Vec::new())
    }
}

/// One log line, written when dropped.
struct LogLine(Vec<u8>);

impl Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        let status = STATUS.lock();
        let mut err = std::io::stderr().lock();
        let shown = status.as_ref().ok().and_then(|s| s.as_deref());
        if shown.is_some() {
            let _ = err.write_all(b"\r\x1b[2K");
        }
        let _ = err.write_all(&self.0);
        if let Some(line) = shown {
            let _ = err.write_all(line.as_bytes());
        }
        let _ = err.flush();
    }
}
