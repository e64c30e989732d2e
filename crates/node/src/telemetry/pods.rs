//! The pods on this node, by UID: what turns a process's cgroup (pod UID, container runtime
//! ID) into namespace, pod and container names, and a claim into the pod that uses it.
//!
//! Followed with a watch on pods with `spec.nodeName=<node>` (list and watch on pods, the
//! one read the kubelet's PodResources API cannot replace: it names pods but not their UIDs or
//! container IDs). Only these small facts are kept, not the pods.

use crate::telemetry::attribute::Workload;
use crate::telemetry::cgroup::ContainerRef;
use crate::telemetry::lock;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tokio_stream::StreamExt;

/// What is kept of one pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodEntry {
    pub namespace: String,
    pub name: String,
    /// Container runtime ID (without the `containerd://` scheme) → container name.
    pub containers: BTreeMap<String, String>,
    /// The ResourceClaims the pod uses, by their object names.
    pub claims: BTreeSet<String>,
}

/// The pods on this node by UID.
#[derive(Debug, Default)]
pub struct PodDirectory {
    pods: Mutex<BTreeMap<String, PodEntry>>,
}

impl PodDirectory {
    /// The named container a process's cgroup points at, if its pod is known.
    pub fn workload(&self, c: &ContainerRef) -> Option<Workload> {
        let pods = lock(&self.pods);
        let pod = pods.get(&c.pod_uid)?;
        Some(Workload {
            namespace: pod.namespace.clone(),
            pod: pod.name.clone(),
            container: pod
                .containers
                .get(&c.container_id)
                .cloned()
                .unwrap_or_default(),
        })
    }

    /// The one pod using claim `namespace/claim`; `None` for none or several.
    pub fn pod_of_claim(&self, namespace: &str, claim: &str) -> Option<String> {
        let pods = lock(&self.pods);
        let mut users = pods
            .values()
            .filter(|p| p.namespace == namespace && p.claims.contains(claim));
        match (users.next(), users.next()) {
            (Some(only), None) => Some(only.name.clone()),
            _ => None,
        }
    }

    /// The UID of pod `namespace/name`, if it is on this node.
    pub fn uid_of(&self, namespace: &str, name: &str) -> Option<String> {
        let pods = lock(&self.pods);
        pods.iter()
            .find(|(_, p)| p.namespace == namespace && p.name == name)
            .map(|(uid, _)| uid.clone())
    }

    fn set(&self, pods: BTreeMap<String, PodEntry>) {
        *lock(&self.pods) = pods;
    }

    fn apply(&self, pod: &Pod) {
        if let Some((uid, entry)) = entry(pod) {
            lock(&self.pods).insert(uid, entry);
        }
    }

    fn delete(&self, pod: &Pod) {
        if let Some(uid) = &pod.metadata.uid {
            lock(&self.pods).remove(uid);
        }
    }
}

/// What the directory keeps of `pod`, under its UID.
pub fn entry(pod: &Pod) -> Option<(String, PodEntry)> {
    let uid = pod.metadata.uid.clone()?;
    let status = pod.status.as_ref();
    let containers = status
        .into_iter()
        .flat_map(|s| {
            let all = [&s.container_statuses, &s.init_container_statuses];
            all.into_iter().flatten().flatten()
        })
        .filter_map(|c| {
            let id = c.container_id.as_deref()?;
            let id = id.split_once("://").map_or(id, |(_, id)| id);
            Some((id.to_string(), c.name.clone()))
        })
        .collect();
    // A claim from a template gets a generated name, found in the status; a claim named in
    // the spec is used as it is.
    let generated = status
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| c.resource_claim_name.clone());
    let named = pod
        .spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| c.resource_claim_name.clone());
    // An extended resource (`nvidia.com/gpu`) that the scheduler satisfied through DRA (a
    // DeviceClass's extendedResourceName, KEP-5004) has a claim generated for the pod, named in
    // `status.extendedResourceClaimStatus`.
    let extended = status
        .and_then(|s| s.extended_resource_claim_status.as_ref())
        .map(|e| e.resource_claim_name.clone());
    let entry = PodEntry {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
        containers,
        claims: generated.chain(named).chain(extended).collect(),
    };
    Some((uid, entry))
}

/// Follows this node's pods into `dir` until `shutdown`; watch errors are retried with the
/// watcher's backoff and logged once per failing stretch.
pub async fn follow(
    client: kube::Client,
    node: String,
    dir: Arc<PodDirectory>,
    mut shutdown: watch::Receiver<bool>,
) {
    let api: kube::Api<Pod> = kube::Api::all(client);
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut events = std::pin::pin!(watcher::watcher(api, config).default_backoff());
    let mut fresh: Option<BTreeMap<String, PodEntry>> = None;
    let mut failing = false;
    loop {
        let event = tokio::select! {
            e = events.next() => e,
            _ = shutdown.changed() => return,
        };
        match event {
            None => return,
            Some(Err(e)) => {
                if !failing {
                    tracing::warn!(%node, error = %e, "watching this node's pods failed; GPU processes are attributed to pods again once it recovers");
                }
                failing = true;
            }
            Some(Ok(event)) => {
                failing = false;
                match event {
                    watcher::Event::Init => fresh = Some(BTreeMap::new()),
                    watcher::Event::InitApply(p) => {
                        if let (Some(f), Some((uid, e))) = (fresh.as_mut(), entry(&p)) {
                            f.insert(uid, e);
                        }
                    }
                    watcher::Event::InitDone => dir.set(fresh.take().unwrap_or_default()),
                    watcher::Event::Apply(p) => dir.apply(&p),
                    watcher::Event::Delete(p) => dir.delete(&p),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_is_kept_by_uid_with_its_container_ids_and_claims() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ml", "uid": "u1"},
            "spec": {"containers": [], "resourceClaims": [
                {"name": "a", "resourceClaimName": "shared-claim"},
                {"name": "b", "resourceClaimTemplateName": "t"}]},
            "status": {
                "containerStatuses": [{"name": "main", "containerID": "containerd://abc",
                    "image": "i", "imageID": "", "ready": true, "restartCount": 0}],
                "resourceClaimStatuses": [{"name": "b", "resourceClaimName": "p-b-x7k"}],
                "extendedResourceClaimStatus": {"resourceClaimName": "p-extended-resources-q2",
                    "requestMappings": [{"containerName": "main", "resourceName": "nvidia.com/gpu",
                        "requestName": "container-0-request-0"}]}}
        }))
        .unwrap();
        let dir = PodDirectory::default();
        dir.apply(&pod);
        let c = ContainerRef {
            pod_uid: "u1".into(),
            container_id: "abc".into(),
        };
        assert_eq!(
            dir.workload(&c),
            Some(Workload {
                namespace: "ml".into(),
                pod: "p".into(),
                container: "main".into()
            })
        );
        assert_eq!(dir.pod_of_claim("ml", "p-b-x7k").as_deref(), Some("p"));
        assert_eq!(dir.pod_of_claim("ml", "shared-claim").as_deref(), Some("p"));
        assert_eq!(
            dir.pod_of_claim("ml", "p-extended-resources-q2").as_deref(),
            Some("p"),
            "a claim the scheduler made for an extended resource"
        );
        assert_eq!(dir.pod_of_claim("other", "shared-claim"), None);
        dir.delete(&pod);
        assert_eq!(dir.workload(&c), None);
    }
}
