//! The webhook and the queue loop at the bench's size (1,000 nodes' ResourceSlices in the
//! catalog, 1,000 pods queued in one namespace): admission of a GPU pod against a pod the
//! webhooks never see, and the time from a GpuQuota raise to the next queued pod's release.

use super::common::{percentiles, row};
use super::setup::gpu_pod;
use super::watch::{self, Shared};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::discovery::ApiResource;
use serde_json::json;
use std::time::{Duration, Instant};

/// Server-side dry-run creates, interleaved: a 2-GPU pod in the Queue-mode namespace (the
/// mutating and validating webhooks price it against the catalog and the GpuQuota, and gate
/// it) against the same pod asking for no GPU, which the webhooks' matchConditions skip.
pub async fn webhook(client: &kube::Client) {
    let api: Api<Pod> = Api::namespaced(client.clone(), "queued");
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let (mut took, mut floor) = (Vec::new(), Vec::new());
    for i in 0..100 {
        let gpu = gpu_pod("queued", &format!("dry-{i}"), 2, None);
        let t0 = Instant::now();
        let p = api.create(&dry, &gpu).await.unwrap();
        took.push(t0.elapsed());
        let gated = p.spec.and_then(|s| s.scheduling_gates).unwrap_or_default();
        assert!(!gated.is_empty(), "the webhook did not gate dry-{i}");
        let mut plain = gpu_pod("queued", &format!("plain-{i}"), 2, None);
        if let Some(c) = plain.spec.as_mut().map(|s| &mut s.containers[0]) {
            c.resources = None;
        }
        let t0 = Instant::now();
        api.create(&dry, &plain).await.unwrap();
        floor.push(t0.elapsed());
    }
    row(
        "webhook: create a queued GPU pod (dry run, 100)",
        percentiles(took),
        percentiles(floor),
    );
}

/// Raises the Queue-mode GpuQuota by one pod's worth (2 GPUs) at a time and times the next
/// queued pod's release (its gate gone, as the bench's watch sees it); floor: the raise's own
/// PATCH round trip.
pub async fn queue(client: &kube::Client, book: &Shared) {
    let quota = ApiResource {
        group: "quota.gpuplane.dev".into(),
        version: "v1alpha1".into(),
        api_version: "quota.gpuplane.dev/v1alpha1".into(),
        kind: "GpuQuota".into(),
        plural: "gpuquotas".into(),
    };
    let quotas: Api<DynamicObject> = Api::namespaced_with(client.clone(), "queued", &quota);
    let released = |b: &watch::Book| {
        b.sightings
            .keys()
            .filter(|k| k.starts_with("ungated:queued/"))
            .count()
    };
    let before = released(&book.lock().unwrap());
    let (mut took, mut floor) = (Vec::new(), Vec::new());
    for k in 1..=20 {
        let hard = json!({"spec": {"hard": {"devices": {"nvidia.com/gpu": 1 + 2 * k}}}});
        let t0 = Instant::now();
        quotas
            .patch("default", &PatchParams::default(), &Patch::Merge(hard))
            .await
            .unwrap();
        floor.push(t0.elapsed());
        watch::until(
            book,
            &format!("queued pod {k} released"),
            super::PATIENCE,
            |b| released(b) >= before + k,
        )
        .await;
        let last = book
            .lock()
            .unwrap()
            .sightings
            .iter()
            .filter(|(key, _)| key.starts_with("ungated:queued/"))
            .map(|(_, at)| *at)
            .max()
            .unwrap();
        took.push(last.saturating_duration_since(t0));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    row(
        "queue: quota raised -> next queued pod released (20)",
        percentiles(took),
        percentiles(floor),
    );
}
