use std::process::ExitCode;
use std::time::Duration;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// How long the exit waits for blocking calls still inside a store's client
/// (a final Kafka commit to a broker that stopped answering): they hold no
/// state of ours, and a stop must not hang on them.
const EXIT_GRACE: Duration = Duration::from_secs(2);

fn main() -> ExitCode {
    let cli = tally::cli::Cli::parse_checked();
    tally::telemetry::init(cli.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: could not start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(async {
        match tally::cli::run(cli).await {
            Ok(code) => code,
            Err(e) => {
                tracing::error!(error = format!("{e:#}"), "tally stopped");
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        }
    });
    runtime.shutdown_timeout(EXIT_GRACE);
    code
}
