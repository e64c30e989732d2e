//! The `gpuplane` command line: parses arguments, picks a device source, runs a face.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use gpuplane::source::{DeviceSource, SimSource};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "gpuplane", version, about = "GPU node agent and quota controller for Kubernetes")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show the GPUs, MIG devices and topology of this node (or of a simulated one).
    Discover {
        #[command(flatten)]
        source: SourceArgs,
        /// Output format.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
        output: Output,
    },
}

/// Where devices come from; shared by every face that reads an inventory.
#[derive(clap::Args)]
struct SourceArgs {
    /// Simulate a machine: a bundled profile name (dgx-a100, dgx-h100, dgx1-v100, pcie-l4x4,
    /// a100-mig-mixed, h100-mig-single) or the path of a profile file.
    #[arg(long, value_name = "PROFILE", conflicts_with = "nvml_lib")]
    simulate: Option<String>,
    /// Path of libnvidia-ml.so.1 (default: the dynamic loader's search path).
    #[arg(long, value_name = "PATH")]
    nvml_lib: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum Output {
    Table,
    Json,
}

impl SourceArgs {
    /// Opens the source and returns it with a label for humans.
    fn open(&self) -> Result<(Box<dyn DeviceSource>, String)> {
        match &self.simulate {
            Some(spec) => {
                let inventory = gpuplane::sim::load(spec)?;
                Ok((Box::new(SimSource::new(inventory)), format!("simulated ({spec})")))
            }
            None => {
                let source = gpuplane::nvml::NvmlSource::open(self.nvml_lib.as_deref())?;
                let label = match &self.nvml_lib {
                    Some(p) => format!("NVML ({})", p.display()),
                    None => "NVML".to_string(),
                };
                Ok((Box::new(source), label))
            }
        }
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Discover { source, output } => {
            let (source, label) = source.open()?;
            let found = source.discover().context("discovering devices")?;
            let text = match output {
                Output::Table => gpuplane::discover::render_table(&label, &found),
                Output::Json => gpuplane::discover::render_json(&label, &found)?,
            };
            print!("{text}");
            Ok(())
        }
    }
}
