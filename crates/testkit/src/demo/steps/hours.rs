//! Step 12: the GPU-hours report. A 2-GPU pod of team-h ran for 90 minutes and finished before
//! the controller started; the controller's new GPU-hours book counts it from its own start.
//! `gpuplane report` (read from the book over the kube client) must give team-h exactly its
//! GPUs times its run, and the GpuQuota's `status.gpuHours` the same seconds for the month.

use super::{poll, Context};
use crate::demo::summary::Outcome;
use crate::demo::{Narrator, CONTROLLER_NAMESPACE, HOURS_NAMESPACE, QUOTA_NAME};
use crate::doubles::lab::NODE;
use gpuplane_cluster::controller::hours::{period_of, By, Report};
use gpuplane_cluster::controller::meter::{report, ReportQuery};
use gpuplane_model::quota::catalog::GPU_RESOURCE;
use gpuplane_model::quota::GpuQuota;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use serde_json::{json, Value};

/// The pod that ran, its GPUs, and its run: it started `AGO` seconds ago and ran `RAN`.
const POD: &str = "finetune";
const GPUS: u64 = 2;
const AGO: i64 = 2 * 3600;
const RAN: i64 = 90 * 60;

/// The finished pod, as its kubelet last reported it: Succeeded, its one container started
/// [`AGO`] seconds ago (whole seconds, as the kubelet reports) and finished [`RAN`] later.
pub fn finished_pod() -> Value {
    let now = Timestamp::now().as_second();
    let at = |s: i64| {
        Timestamp::from_second(s)
            .unwrap_or(Timestamp::UNIX_EPOCH)
            .to_string()
    };
    let (start, finish) = (at(now - AGO), at(now - AGO + RAN));
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": POD, "namespace": HOURS_NAMESPACE, "uid": format!("uid-{HOURS_NAMESPACE}-{POD}"),
            "labels": {"team": "ml"}},
        "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": "cuda",
            "resources": {"limits": {GPU_RESOURCE: GPUS.to_string()}}}]},
        "status": {"phase": "Succeeded", "containerStatuses": [{"name": "main", "image": "cuda",
            "imageID": "", "ready": false, "restartCount": 0,
            "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                "startedAt": start, "finishedAt": finish}}}]}
    })
}

pub(super) async fn run(cx: &Context<'_>, say: &mut Narrator<'_>) -> Outcome {
    let ns = HOURS_NAMESPACE;
    let (start, finish) = match run_times(cx).await {
        Ok(t) => t,
        Err(e) => return Outcome::Failed(e),
    };
    let want = (GPUS as i64 * (finish.as_second() - start.as_second())) as f64;
    say.say(format!(
        "pod {ns}/{POD} ran {GPUS} x {GPU_RESOURCE} from {start} to {finish} and finished before the controller started"
    ));
    let q = ReportQuery {
        controller_namespace: CONTROLLER_NAMESPACE.into(),
        by: By::Namespace,
        namespace: Some(ns.into()),
        since: Some(start.to_string()),
        until: None,
    };
    let rep = match poll(|| booked(cx, &q, want)).await {
        Ok(r) => r,
        Err(e) => return Outcome::Failed(format!("the report never showed {ns}'s run: {e}")),
    };
    for line in rep.table().lines() {
        say.say(format!(
            "gpuplane report -n {ns} --since {}: {line}",
            day(&start)
        ));
    }
    let row = rep.rows.iter().find(|r| r.tenant == ns);
    let hours = row.map_or(0.0, |r| r.gpu_hours);
    // The quota's status holds the current month: all of the run unless it began last month.
    let now = Timestamp::now().as_millisecond();
    let month = (period_of(start.as_millisecond()) == period_of(now)).then_some(want);
    match quota_seconds(cx, month).await {
        Ok(seen) => {
            say.say(format!(
                "GpuQuota {ns}/{QUOTA_NAME} status.gpuHours: {seen}"
            ));
            Outcome::Held(format!(
                "{ns}: {hours:.3} GPU-hours = {GPUS} GPUs x {:.1} h, in `gpuplane report` and the GpuQuota's status.gpuHours ({seen})",
                (finish.as_second() - start.as_second()) as f64 / 3600.0
            ))
        }
        Err(e) => Outcome::Failed(e),
    }
}

/// The day of `t`, as `--since` takes it.
fn day(t: &Timestamp) -> String {
    let mut s = t.to_string();
    s.truncate(10);
    s
}

/// The finished pod's run as the API server has it: its container's start and finish.
async fn run_times(cx: &Context<'_>) -> Result<(Timestamp, Timestamp), String> {
    let p = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(cx.client.clone(), HOURS_NAMESPACE)
        .get(POD)
        .await
        .map_err(|e| format!("reading pod {HOURS_NAMESPACE}/{POD}: {e}"))?;
    let t = p
        .status
        .and_then(|s| s.container_statuses)
        .into_iter()
        .flatten()
        .find_map(|c| c.state?.terminated)
        .ok_or_else(|| format!("pod {POD} has no finished container"))?;
    match (t.started_at, t.finished_at) {
        (Some(s), Some(f)) => Ok((s.0, f.0)),
        _ => Err(format!("pod {POD}'s container has no start or finish")),
    }
}

/// The report once it counts `want` GPU-seconds for the namespace.
async fn booked(cx: &Context<'_>, q: &ReportQuery, want: f64) -> Result<Report, String> {
    let rep = report(&cx.client, q).await.map_err(|e| e.to_string())?;
    let seconds: f64 = rep.rows.iter().map(|r| r.gpu_seconds).sum();
    match (seconds - want).abs() < 0.5 {
        true => Ok(rep),
        false => Err(format!("{seconds} GPU-seconds booked, not {want}")),
    }
}

/// The GpuQuota's `status.gpuHours`, once it holds `want` GPU-seconds (if given).
async fn quota_seconds(cx: &Context<'_>, want: Option<f64>) -> Result<String, String> {
    let quotas: Api<GpuQuota> = Api::namespaced(cx.client.clone(), HOURS_NAMESPACE);
    poll(|| async {
        let q = quotas.get(QUOTA_NAME).await.map_err(|e| e.to_string())?;
        let h = q.status.and_then(|s| s.gpu_hours);
        match (h, want) {
            (Some(h), Some(w)) if (h.gpu_seconds - w).abs() < 0.5 => {
                Ok(format!("period {}, gpuSeconds {}", h.period, h.gpu_seconds))
            }
            (Some(h), None) => Ok(format!(
                "period {}, gpuSeconds {} (the run began last month)",
                h.period, h.gpu_seconds
            )),
            (h, _) => Err(format!("status.gpuHours {h:?}")),
        }
    })
    .await
    .map_err(|e| format!("GpuQuota {HOURS_NAMESPACE}/{QUOTA_NAME}'s status.gpuHours: {e}"))
}
