//! Keeps this node's GPU labels ([`crate::labels`]) in step with the inventory and the config:
//! when the labels they call for change, and every few minutes (someone may have edited them),
//! it reads the Node and sends a JSON merge patch of the managed labels that differ. A merge patch, not
//! server-side apply: it fails on a missing Node instead of creating one. Failures are logged
//! once per distinct error and retried; they never affect the kubelet APIs.

use crate::labels::{label_patch, node_labels};
use crate::state::NodeState;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How often the node's labels are read again without a state change.
const RESYNC: Duration = Duration::from_secs(300);
/// How soon a failed read or patch is tried again.
const RETRY: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
enum LabelError {
    #[error("reading node {node}: {cause}")]
    Read { node: String, cause: kube::Error },
    #[error("node {0} does not exist (yet)")]
    Missing(String),
    #[error("patching the labels of node {node}: {cause}")]
    Patch { node: String, cause: kube::Error },
}

/// Runs until `stop` turns true.
pub async fn run(
    client: kube::Client,
    node: String,
    state: Arc<NodeState>,
    mut stop: watch::Receiver<bool>,
) {
    let nodes: kube::Api<Node> = kube::Api::all(client);
    let mut changes = state.subscribe();
    let mut last_error: Option<String> = None;
    // What the node was last brought to, and when to look again regardless. The state changes
    // on every hand-out and health tick; only a change of the wanted labels is worth a read.
    let mut synced: Option<BTreeMap<String, String>> = None;
    let mut next = tokio::time::Instant::now();
    loop {
        let wanted = {
            let snap = state.read();
            node_labels(&snap.inventory, &snap.config)
        };
        if synced.as_ref() != Some(&wanted) || tokio::time::Instant::now() >= next {
            let wait = match sync(&nodes, &node, &wanted).await {
                Ok(changed) => {
                    if changed || last_error.is_some() {
                        tracing::info!(%node, labels = wanted.len(), "node labels in step");
                    }
                    last_error = None;
                    synced = Some(wanted);
                    RESYNC
                }
                Err(e) => {
                    let text = e.to_string();
                    if last_error.as_deref() != Some(text.as_str()) {
                        tracing::warn!(%node, error = %text, "node labels not written; retrying");
                        last_error = Some(text);
                    }
                    synced = None;
                    RETRY
                }
            };
            next = tokio::time::Instant::now() + wait;
        }
        tokio::select! {
            r = changes.changed() => if r.is_err() { return },
            _ = tokio::time::sleep_until(next) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// Brings the node's managed labels to `wanted`; whether it had to write.
async fn sync(
    nodes: &kube::Api<Node>,
    node: &str,
    wanted: &BTreeMap<String, String>,
) -> Result<bool, LabelError> {
    let current = nodes
        .get_opt(node)
        .await
        .map_err(|cause| LabelError::Read {
            node: node.to_string(),
            cause,
        })?
        .ok_or_else(|| LabelError::Missing(node.to_string()))?
        .metadata
        .labels
        .unwrap_or_default();
    let Some(patch) = label_patch(&current, wanted) else {
        return Ok(false);
    };
    nodes
        .patch(node, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .map_err(|cause| LabelError::Patch {
            node: node.to_string(),
            cause,
        })?;
    Ok(true)
}
