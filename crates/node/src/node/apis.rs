//! What the agent serves on this node: the kubelet APIs (the `--device-plugin`/`--dra` flags,
//! or the node's label `gpuplane.dev/apis`: `device-plugin`, `dra` or `both`) and whether it
//! shares GPUs through consumable capacity (the config's `sharing.consumableCapacity`, or the
//! label `gpuplane.dev/sharing`: `on` or `off`), so one DaemonSet can serve node pools
//! differently (docs/migrating.md). The labels are read at start; when one changes, the agent
//! stops so that the DaemonSet starts it again with the new choice (the checkpoint keeps every
//! device and share held across the restart).

use k8s_openapi::api::core::v1::Node;
use kube::runtime::watcher;
use std::fmt;
use tokio_stream::StreamExt;

/// The node label that chooses the APIs.
pub const APIS_LABEL: &str = "gpuplane.dev/apis";
/// The node label that turns consumable-capacity sharing on or off.
pub const SHARING_LABEL: &str = "gpuplane.dev/sharing";

/// What the agent serves: the APIs, and the sharing switch (`None`: the config decides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Serving {
    pub apis: Apis,
    pub sharing: Option<bool>,
}

impl fmt::Display for Serving {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sharing = match self.sharing {
            None => "as configured",
            Some(true) => "on",
            Some(false) => "off",
        };
        write!(f, "APIs {}, sharing {sharing}", self.apis)
    }
}

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
    #[error(
        "node {node}: label {SHARING_LABEL}={value:?} is not on or off; fix the label (or \
         remove it to share as the config's sharing.consumableCapacity says)"
    )]
    BadSharingLabel { node: String, value: String },
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

/// What `node` (its labels, when its Node object is known) asks to serve, else `flags` and
/// the config.
pub fn choose_serving(name: &str, node: Option<&Node>, flags: Apis) -> Result<Serving, ApisError> {
    let label = |key| node.and_then(|n| node_label(n, key));
    let apis = choose(name, label(APIS_LABEL).as_deref(), flags)?;
    let sharing = match label(SHARING_LABEL).as_deref() {
        None => None,
        Some("on") => Some(true),
        Some("off") => Some(false),
        Some(other) => {
            return Err(ApisError::BadSharingLabel {
                node: name.to_string(),
                value: other.to_string(),
            })
        }
    };
    Ok(Serving { apis, sharing })
}

/// The value of label `key` on `node`, if it has it.
pub fn node_label(node: &Node, key: &str) -> Option<String> {
    node.metadata.labels.as_ref()?.get(key).cloned()
}

/// The Node object; `None` when it does not exist (an agent run outside a cluster node).
pub async fn read_node(client: &kube::Client, node: &str) -> Result<Option<Node>, ApisError> {
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    nodes.get_opt(node).await.map_err(|cause| ApisError::Read {
        node: node.to_string(),
        cause,
    })
}

/// What to serve on `node`: its labels' choice, else `flags` and the config. Labels that
/// cannot be read now (API away, no Node object yet) mean the flags and the config, with a
/// warning: [`changed`] then stops the agent once they are readable and ask for something else.
pub async fn resolve(client: &kube::Client, node: &str, flags: Apis) -> Result<Serving, ApisError> {
    let object = match read_node(client, node).await {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(error = %e, "using the --device-plugin/--dra flags and the config");
            None
        }
    };
    let serving = choose_serving(node, object.as_ref(), flags)?;
    let from = |key: &'static str, otherwise: &'static str| match object
        .as_ref()
        .and_then(|n| node_label(n, key))
    {
        Some(_) => key,
        None => otherwise,
    };
    tracing::info!(%node, apis = %serving.apis, from = from(APIS_LABEL, "flags"), "kubelet APIs");
    if serving.sharing.is_some() {
        tracing::info!(%node, %serving, from = SHARING_LABEL, "consumable-capacity sharing");
    }
    Ok(serving)
}

/// Resolves once the node's labels ask for something else than `serving` (a bad value counts
/// as a change: the restarted agent then refuses to start, naming it). Watch errors are retried
/// by the watcher with backoff; they never end the agent.
pub async fn changed(client: kube::Client, node: String, flags: Apis, serving: Serving) {
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
        let wanted = choose_serving(&node, Some(&n), flags);
        if wanted.as_ref().ok() != Some(&serving) {
            let now = wanted.map_or_else(|e| e.to_string(), |a| a.to_string());
            tracing::warn!(
                %node,
                %serving,
                wanted = %now,
                "label {APIS_LABEL} or {SHARING_LABEL} changed; stopping so that the agent is started again with it"
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
