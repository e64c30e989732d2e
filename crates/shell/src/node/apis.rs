//! Which kubelet APIs the agent serves on this node: the `--device-plugin`/`--dra` flags, or
//! the node's label `gpuplane.dev/apis` (`device-plugin`, `dra` or `both`) when it has one, so
//! one DaemonSet can serve node pools differently (docs/migrating.md). The label is read at
//! start; when it changes, the agent stops so that the DaemonSet starts it again with the new
//! APIs (the ledger's checkpoint keeps every device held across the restart).

use k8s_openapi::api::core::v1::Node;
use kube::runtime::watcher;
use std::fmt;
use tokio_stream::StreamExt;

/// The node label that chooses the APIs.
pub const APIS_LABEL: &str = "gpuplane.dev/apis";

/// What the agent serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Apis {
    pub device_plugin: bool,
    pub dra: bool,
}

impl fmt::Display for Apis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match (self.device_plugin, self.dra) {
            (true, true) => "both",
            (true, false) => "device-plugin",
            (false, true) => "dra",
            (false, false) => "none",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ApisError {
    #[error(
        "node {node}: label {APIS_LABEL}={value:?} is not one of device-plugin, dra, both; fix \
         the label (or remove it to use the --device-plugin/--dra flags)"
    )]
    BadLabel { node: String, value: String },
    /// The cause is in the message (not a `source`), so a log line shows it once.
    #[error("reading node {node} for its {APIS_LABEL} label: {cause}")]
    Read { node: String, cause: kube::Error },
}

/// The APIs a label value asks for; `None` for a value that is not one of the three.
pub fn parse(value: &str) -> Option<Apis> {
    match value {
        "both" => Some(Apis {
            device_plugin: true,
            dra: true,
        }),
        "device-plugin" => Some(Apis {
            device_plugin: true,
            dra: false,
        }),
        "dra" => Some(Apis {
            device_plugin: false,
            dra: true,
        }),
        _ => None,
    }
}

/// The APIs for a node with label value `label` (if any), else `flags`.
pub fn choose(node: &str, label: Option<&str>, flags: Apis) -> Result<Apis, ApisError> {
    match label {
        None => Ok(flags),
        Some(v) => parse(v).ok_or_else(|| ApisError::BadLabel {
            node: node.to_string(),
            value: v.to_string(),
        }),
    }
}

fn label_of(node: &Node) -> Option<String> {
    node_label(node, APIS_LABEL)
}

/// The value of label `key` on `node`, if it has it.
pub fn node_label(node: &Node, key: &str) -> Option<String> {
    node.metadata.labels.as_ref()?.get(key).cloned()
}

/// The node's label value; `None` when it has none, or when the Node object does not exist
/// (an agent run outside a cluster node).
pub async fn read_label(client: &kube::Client, node: &str) -> Result<Option<String>, ApisError> {
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    match nodes.get_opt(node).await {
        Ok(n) => Ok(n.as_ref().and_then(label_of)),
        Err(cause) => Err(ApisError::Read {
            node: node.to_string(),
            cause,
        }),
    }
}

/// The APIs to serve on `node`: its label's, else `flags`. A label that cannot be read now
/// (API away, no Node object yet) means the flags, with a warning: [`changed`] then stops the
/// agent once the label is readable and asks for something else.
pub async fn resolve(client: &kube::Client, node: &str, flags: Apis) -> Result<Apis, ApisError> {
    let label = match read_label(client, node).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "using the --device-plugin/--dra flags");
            None
        }
    };
    let serving = choose(node, label.as_deref(), flags)?;
    tracing::info!(
        %node,
        apis = %serving,
        from = if label.is_some() { APIS_LABEL } else { "flags" },
        "kubelet APIs"
    );
    Ok(serving)
}

/// Resolves once the node's label asks for other APIs than `serving` (a bad value counts as a
/// change: the restarted agent then refuses to start, naming it). Watch errors are retried
/// by the watcher with backoff; they never end the agent.
pub async fn changed(client: kube::Client, node: String, flags: Apis, serving: Apis) {
    let nodes: kube::Api<Node> = kube::Api::all(client);
    let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    let mut events = std::pin::pin!(watcher::watcher(nodes, config));
    while let Some(event) = events.next().await {
        let n = match event {
            Ok(watcher::Event::Apply(n)) | Ok(watcher::Event::InitApply(n)) => n,
            Ok(_) => continue,
            Err(e) => {
                tracing::debug!(%node, error = %e, "watching the node's labels; retrying");
                continue;
            }
        };
        let label = label_of(&n);
        let wanted = choose(&node, label.as_deref(), flags);
        if wanted.as_ref().ok() != Some(&serving) {
            let now = wanted.map_or_else(|e| e.to_string(), |a| a.to_string());
            tracing::warn!(
                %node,
                serving = %serving,
                wanted = %now,
                "label {APIS_LABEL} changed; stopping so that the agent is started again with it"
            );
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLAGS: Apis = Apis {
        device_plugin: true,
        dra: true,
    };

    #[test]
    fn the_label_overrides_the_flags_and_a_bad_value_is_named() {
        assert_eq!(choose("n", None, FLAGS).unwrap(), FLAGS);
        let dra = choose("n", Some("dra"), FLAGS).unwrap();
        assert!(!dra.device_plugin && dra.dra);
        let dp = choose("n", Some("device-plugin"), FLAGS).unwrap();
        assert!(dp.device_plugin && !dp.dra);
        assert_eq!(choose("n", Some("both"), FLAGS).unwrap(), FLAGS);
        let err = choose("gpu-7", Some("DRA"), FLAGS).unwrap_err().to_string();
        assert!(
            err.contains("node gpu-7")
                && err.contains("\"DRA\"")
                && err.contains("device-plugin, dra, both"),
            "{err}"
        );
    }

    #[test]
    fn apis_print_as_the_label_values() {
        for v in ["both", "device-plugin", "dra"] {
            assert_eq!(parse(v).unwrap().to_string(), v);
        }
    }
}
