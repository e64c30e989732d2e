//! Where devices come from: the flags every face that reads an inventory shares (`--simulate`,
//! `--nvml-lib`), and how each face opens its source.

use anyhow::{bail, Context, Result};
use gpuplane_model::source::{DeviceSource, SimSource};
use std::path::{Path, PathBuf};

/// Where devices come from; shared by every face that reads an inventory.
#[derive(clap::Args)]
pub struct SourceArgs {
    /// Simulate a machine: a bundled profile name (dgx-a100, dgx-h100, dgx1-v100, pcie-l4x4,
    /// a100-mig-mixed, h100-mig-single, dynamic-mig-mixed) or the path of a profile file. The
    /// node agent then needs no device nodes: containers get each device's identity in their
    /// environment (GPUPLANE_DEVICE_*, NVIDIA_VISIBLE_DEVICES) instead.
    #[arg(long, value_name = "PROFILE", conflicts_with = "nvml_lib")]
    pub simulate: Option<String>,
    /// Path of libnvidia-ml.so.1 (default: the dynamic loader's search path).
    #[arg(long, value_name = "PATH")]
    pub nvml_lib: Option<PathBuf>,
}

impl SourceArgs {
    /// Opens the source and returns it with a label for humans.
    pub fn open(&self) -> Result<(Box<dyn DeviceSource>, String)> {
        match &self.simulate {
            Some(spec) => {
                let inventory = gpuplane_model::sim::load(spec)?;
                Ok((
                    Box::new(SimSource::new(inventory)),
                    format!("simulated ({spec})"),
                ))
            }
            None => {
                let source = gpuplane_node::nvml::NvmlSource::open(self.nvml_lib.as_deref())?;
                Ok((Box::new(source), self.nvml_label()))
            }
        }
    }

    /// Simulated devices exist only in the profile; NVML (also a fake libnvidia-ml) means
    /// real device nodes and driver files.
    pub fn mode(&self) -> gpuplane_model::source::DeviceMode {
        match self.simulate {
            Some(_) => gpuplane_model::source::DeviceMode::Simulated,
            None => gpuplane_model::source::DeviceMode::Hardware,
        }
    }

    fn nvml_label(&self) -> String {
        match &self.nvml_lib {
            Some(p) => format!("NVML ({})", p.display()),
            None => "NVML".to_string(),
        }
    }

    /// For the agent: NVML that cannot be opened yet is retried by the agent with backoff
    /// (node::deferred) instead of ending the process; a simulated machine keeps its MIG
    /// instances and compute modes in `state_dir` across agent restarts, as a driver would
    /// (node::kept_sim).
    /// `telemetry`: `--simulate-telemetry`, read into a simulated machine.
    pub fn open_for_agent(
        &self,
        state_dir: &Path,
        boot_id: &Path,
        telemetry: Option<&Path>,
    ) -> Result<(Box<dyn DeviceSource>, String)> {
        if let Some(spec) = &self.simulate {
            let sim = SimSource::new(gpuplane_model::sim::load(spec)?);
            if let Some(file) = telemetry {
                gpuplane_node::node::sim_telemetry::follow(sim.clone(), file.to_path_buf())
                    .context("starting the --simulate-telemetry reader")?;
            }
            let boot = gpuplane_node::dra::checkpoint::read_boot_id(boot_id);
            let kept = gpuplane_node::node::kept_sim::KeptSim::open(sim, state_dir, boot);
            return Ok((Box::new(kept), format!("simulated ({spec})")));
        }
        if let Some(file) = telemetry {
            bail!(
                "--simulate-telemetry {} drives a simulated machine only; add --simulate (or \
                 --simulate-from-node-label), or drop it: with NVML the driver reports telemetry",
                file.display()
            );
        }
        let lib = self.nvml_lib.clone();
        let source = gpuplane_node::node::deferred::Deferred::new(move || {
            let nvml = gpuplane_node::nvml::NvmlSource::open(lib.as_deref())?;
            Ok(Box::new(nvml) as Box<dyn DeviceSource>)
        });
        Ok((Box::new(source), self.nvml_label()))
    }
}
