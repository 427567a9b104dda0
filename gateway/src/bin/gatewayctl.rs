//! `gatewayctl`: admin CLI (see `gateway::ctl`).

use clap::Parser;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    let cli = gateway::ctl::Cli::parse();
    match gateway::ctl::run(cli, &mut std::io::stdout()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // The reader went away (`gatewayctl report weekly | head`): nothing more to say.
        Err(e) if closed_pipe(&e) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn closed_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
