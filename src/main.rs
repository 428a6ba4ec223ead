use std::process::ExitCode;

use clap::Parser;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = tally::cli::Cli::parse();
    tally::telemetry::init(cli.log_format);
    match tally::cli::run(cli).await {
        Ok(code) => code,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "tally stopped");
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
