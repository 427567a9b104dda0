//! `gatewayctl`: admin CLI (see `gateway::ctl`).

use clap::Parser;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let cli = gateway::ctl::Cli::parse();
    match gateway::ctl::run(cli, &mut std::io::stdout()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
