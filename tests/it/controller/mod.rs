//! The quota controller's loops against the API server double with the real kube client:
//! leader election over a Lease, and the queue that releases gated GPU pods.

use crate::support::eventually::{eventually_async, LIMIT};
use gpuplane_cluster::controller::lease::LeaseTimings;
use gpuplane_cluster::controller::namespace::QueueSettings;
use gpuplane_cluster::controller::queue::{self, QueueOptions};
use gpuplane_cluster::controller_metrics::QueueMetrics;
use gpuplane_cluster::elector::{self, Elector, Role};
use gpuplane_model::quota::{GpuQuota, GpuQuotaSpec, Gpus, Limits, QuotaMode, SCHEDULING_GATE};
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::ResourceExt;
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

mod election;
mod kueue;
mod pending_reasons;
mod queue_label;
mod release_queue;

const NS: &str = "gpuplane-system";
const LEASE: &str = "gpuplane-controller";

async fn lease(server: &ApiServerDouble) -> Lease {
    let api: Api<Lease> = Api::namespaced(server.client().unwrap(), NS);
    api.get(LEASE).await.unwrap()
}

const QNS: &str = "team-a";

struct Lab {
    server: ApiServerDouble,
    pods: Api<Pod>,
    metrics: Arc<QueueMetrics>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Lab {
    /// A Queue-mode GpuQuota `team-a/default` of `gpus` GPUs, and the loop running.
    async fn start(gpus: u64, bound: Duration) -> Lab {
        Lab::start_beside(gpus, bound, false).await
    }

    /// [`Lab::start`], the controller told whether Kueue runs in the cluster (`--kueue`).
    async fn start_beside(gpus: u64, bound: Duration, kueue: bool) -> Lab {
        let server = ApiServerDouble::start().await.unwrap();
        let client = server.client().unwrap();
        let quotas: Api<GpuQuota> = Api::namespaced(client.clone(), QNS);
        let spec = GpuQuotaSpec {
            hard: Limits {
                gpus: Some(Gpus::whole(gpus)),
                ..Limits::default()
            },
            mode: QuotaMode::Queue,
            ..GpuQuotaSpec::default()
        };
        quotas
            .create(&PostParams::default(), &GpuQuota::new("default", spec))
            .await
            .unwrap();
        let metrics = Arc::new(QueueMetrics::default());
        let opts = QueueOptions {
            settings: QueueSettings {
                bound,
                grace: Duration::from_secs(120),
                kueue,
            },
            batch: Duration::from_millis(20),
            resync: Duration::from_millis(500),
            note_refresh: Duration::from_millis(200),
            ..QueueOptions::default()
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let m = metrics.clone();
        let task = tokio::spawn(async move {
            let devices = gpuplane_cluster::published::Devices::start(
                &client,
                opts.catalog.clone(),
                |_, _| {},
            );
            queue::run(client, opts, devices, m, async {
                let _ = stopped.await;
            })
            .await
        });
        Lab {
            pods: Api::namespaced(server.client().unwrap(), QNS),
            server,
            metrics,
            stop: Some(stop),
            task: Some(task),
        }
    }

    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap();
        }
    }

    async fn create(&self, pod: serde_json::Value) -> Pod {
        let pod: Pod = serde_json::from_value(pod).unwrap();
        self.pods
            .create(&PostParams::default(), &pod)
            .await
            .unwrap()
    }

    async fn quota(&self) -> GpuQuota {
        let q: Api<GpuQuota> = Api::namespaced(self.server.client().unwrap(), QNS);
        q.get("default").await.unwrap()
    }

    /// Waits until the loop has run `n` more namespace reconciles and the quota has
    /// settled (used by tests that step the world).
    async fn cycles(&self, n: u64) {
        let start = self.metrics.snapshot().cycles;
        eventually_async("the loop to run", LIMIT, || async {
            self.metrics.snapshot().cycles >= start + n
        })
        .await;
    }
}

/// A GPU pod: gated (queued) or running on a node.
fn pod(name: &str, gpus: u32, gated: bool) -> serde_json::Value {
    let mut spec = json!({
        "containers": [{
            "name": "main",
            "image": "busybox",
            "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}
        }]
    });
    if gated {
        spec["schedulingGates"] = json!([{"name": SCHEDULING_GATE}]);
    } else {
        spec["nodeName"] = json!("node-1");
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": QNS},
        "spec": spec
    })
}

fn condition(p: &Pod) -> Option<(String, String, String)> {
    condition_of(p, "QuotaAdmitted")
}

/// The condition of type `type_` on `p`: status, reason, message.
fn condition_of(p: &Pod, type_: &str) -> Option<(String, String, String)> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| {
            (
                c.status.clone(),
                c.reason.clone().unwrap_or_default(),
                c.message.clone().unwrap_or_default(),
            )
        })
}

async fn events_for(server: &ApiServerDouble, pod: &str) -> Vec<Event> {
    let api: Api<Event> = Api::namespaced(server.client().unwrap(), QNS);
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.involved_object.name.as_deref() == Some(pod))
        .collect()
}

async fn delete(lab: &Lab, name: &str) {
    lab.pods
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
}

fn names(pods: &[Pod]) -> Vec<String> {
    pods.iter().map(|p| p.name_any()).collect()
}

fn namespace(server: &ApiServerDouble, name: &str, labels: serde_json::Value) {
    server
        .put_json(json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": labels, "annotations": {"owner": "team"}},
            "spec": {"finalizers": ["kubernetes"]}}))
        .unwrap();
}
