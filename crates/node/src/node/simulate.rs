//! `--simulate-from-node-label`: the machine a node simulates comes from its label
//! `gpuplane.dev/simulate` (a bundled profile name, e.g. `dgx-h100`), read once at start, so
//! one DaemonSet serves a dgx-h100 node, an a100-mig-mixed node and a pcie-l4x4 node, and a
//! cluster without GPUs can try gpuplane. Only bundled names are taken: a label must never make
//! the agent read a file of the node's choosing.

use super::apis::node_label;
use gpuplane_model::report::chain;
use k8s_openapi::api::core::v1::Node;
use std::time::Duration;

/// The node label naming the profile to simulate.
pub const SIMULATE_LABEL: &str = "gpuplane.dev/simulate";

/// Reading the Node is retried this often before the start fails (a pod starting while the
/// API server is briefly away should not crash-loop, one that cannot read it at all should).
const ATTEMPTS: u32 = 10;
const PAUSE: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum SimulateLabelError {
    #[error(
        "node {node}: label {SIMULATE_LABEL}={value:?} is not a bundled profile ({}); fix the \
         label or remove it to use the --simulate/--nvml-lib flags",
        crate::sim::bundled_names().join(", ")
    )]
    Unknown { node: String, value: String },
    #[error("reading node {node} for its {SIMULATE_LABEL} label ({attempts} attempts): {}; check the agent's API access (its ServiceAccount may get nodes)", chain(.cause))]
    Read {
        node: String,
        attempts: u32,
        cause: kube::Error,
    },
}

/// The profile `value` names, if it is a bundled one.
pub fn profile(node: &str, value: &str) -> Result<String, SimulateLabelError> {
    crate::sim::bundled_names()
        .into_iter()
        .find(|n| *n == value)
        .map(str::to_string)
        .ok_or_else(|| SimulateLabelError::Unknown {
            node: node.to_string(),
            value: value.to_string(),
        })
}

/// The bundled profile node `node`'s label names; `None` when it has no such label (or there
/// is no Node object of that name).
pub async fn profile_from_label(
    client: &kube::Client,
    node: &str,
) -> Result<Option<String>, SimulateLabelError> {
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    let mut attempt = 1;
    let found = loop {
        match nodes.get_opt(node).await {
            Ok(n) => break n,
            Err(cause) if attempt >= ATTEMPTS => {
                return Err(SimulateLabelError::Read {
                    node: node.to_string(),
                    attempts: attempt,
                    cause,
                })
            }
            Err(e) => {
                tracing::warn!(%node, error = %e, attempt, "reading the node for its {SIMULATE_LABEL} label; retrying");
                attempt += 1;
                tokio::time::sleep(PAUSE).await;
            }
        }
    };
    let Some(value) = found.as_ref().and_then(|n| node_label(n, SIMULATE_LABEL)) else {
        tracing::info!(%node, "no {SIMULATE_LABEL} label: using the device source flags");
        return Ok(None);
    };
    let profile = profile(node, &value)?;
    tracing::info!(%node, %profile, "simulating the machine the node's {SIMULATE_LABEL} label names");
    Ok(Some(profile))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bundled_profiles_are_taken_and_a_bad_value_is_named() {
        assert_eq!(profile("n", "dgx-h100").unwrap(), "dgx-h100");
        let err = profile("gpu-3", "etc").unwrap_err().to_string();
        assert!(
            err.contains("node gpu-3") && err.contains("\"etc\"") && err.contains("pcie-l4x4"),
            "{err}"
        );
    }
}
