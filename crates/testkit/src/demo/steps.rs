//! The demo's seven steps. Each makes real calls (gRPC to the agent through the kubelet doubles,
//! HTTPS AdmissionReviews to the webhook, the kube client to the API server double), narrates
//! what came back, and judges the step from those answers only. A step the machine cannot show
//! (too few GPUs, no NVLink) is skipped with the reason.

use super::facts::{self, PublishedDevice};
use super::summary::{Outcome, Step};
use super::tls::DemoPki;
use super::{Narrator, QUEUE_GPUS, QUEUE_NAMESPACE, QUOTA_NAME, REJECT_GPUS, REJECT_NAMESPACE};
use crate::doubles::admission::pod_create_review;
use crate::doubles::lab::{NodeLab, NODE};
use gpuplane_shell::controller::metrics::QueueMetrics;
use gpuplane_shell::controller::pods::{GROUP_LABEL, GROUP_SIZE_ANNOTATION};
use gpuplane_shell::dra::ClaimRef;
use gpuplane_shell::inventory::{DeviceRef, Inventory};
use gpuplane_shell::proto::dra_health_v1::HealthStatus;
use gpuplane_shell::quota::catalog::GPU_RESOURCE;
use gpuplane_shell::quota::{GpuQuota, ReservationState, SCHEDULING_GATE};
use gpuplane_shell::slices::render::UNHEALTHY_TAINT_KEY;
use gpuplane_shell::topology::TopologyModel;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a step waits for something to happen before it says it did not.
const WAIT: Duration = Duration::from_secs(15);
/// The namespace of the node-level steps' pods and claims.
const NODE_NAMESPACE: &str = "demo";
/// GPUs of the topology step's request.
const REQUEST: usize = 4;
/// A critical Xid (double-bit ECC error): not on NVIDIA's list of application-caused ones.
const XID: u64 = 48;

/// What the steps talk to.
pub struct Context<'a> {
    pub lab: &'a NodeLab,
    pub inventory: &'a Inventory,
    pub client: kube::Client,
    /// The webhook's HTTPS address.
    pub webhook: SocketAddr,
    pub pki: &'a DemoPki,
    pub queue: Arc<QueueMetrics>,
    pub profile: &'a str,
}

/// What a step leaves for later ones.
#[derive(Debug, Default)]
pub struct Carry {
    /// Device-plugin IDs the 4-GPU pod holds (step 2).
    pod_ids: Vec<String>,
    /// The claim prepared in step 3 and its device.
    claim: Option<(ClaimRef, PublishedDevice)>,
}

/// Runs one step.
pub async fn run(
    step: Step,
    cx: &Context<'_>,
    carry: &mut Carry,
    say: &mut Narrator<'_>,
) -> Outcome {
    match step {
        Step::Inventory => inventory(cx, say).await,
        Step::NvlinkAllocation => nvlink_allocation(cx, carry, say).await,
        Step::DraClaim => dra_claim(cx, carry, say).await,
        Step::LedgerRefusal => ledger_refusal(cx, carry, say).await,
        Step::Quota => quota(cx, say).await,
        Step::PodGroup => pod_group(cx, say).await,
        Step::XidHealth => xid_health(cx, carry, say).await,
    }
}

/// Polls `probe` until it answers `Ok`, for at most [`WAIT`]; on time-out, the last thing it
/// saw.
async fn poll<T, F, Fut>(mut probe: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        match probe().await {
            Ok(v) => return Ok(v),
            Err(seen) if Instant::now() >= deadline => {
                return Err(format!("after {}s: {seen}", WAIT.as_secs()))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(25)).await,
        }
    }
}

/// The ResourceSlices as the API server serves them.
async fn published(
    client: &kube::Client,
) -> Result<(Vec<ResourceSlice>, Vec<PublishedDevice>), String> {
    let slices = Api::<ResourceSlice>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(|e| format!("listing ResourceSlices: {e}"))?
        .items;
    let devices = facts::published_devices(&slices);
    Ok((slices, devices))
}

/// Device-plugin ID -> (resource, health), over every resource the kubelet double follows.
fn listed(lab: &NodeLab) -> BTreeMap<String, (String, String)> {
    lab.kubelet
        .plugins()
        .into_iter()
        .flat_map(|(r, v)| {
            v.devices
                .into_iter()
                .map(move |d| (d.id, (r.clone(), d.health)))
        })
        .collect()
}

fn gpu_index(inv: &Inventory, uuid: &str) -> Option<u32> {
    inv.gpus.iter().find(|g| g.uuid == uuid).map(|g| g.index)
}

fn list(items: &[String]) -> String {
    items.join(", ")
}

async fn inventory(cx: &Context<'_>, say: &mut Narrator<'_>) -> Outcome {
    let inv = cx.inventory;
    let mut products: BTreeMap<(&str, u64), usize> = BTreeMap::new();
    for g in &inv.gpus {
        *products.entry((&g.product_name, g.memory_mib)).or_default() += 1;
    }
    for ((product, mib), n) in &products {
        say.say(format!(
            "{n} x {product} ({:.1} GiB), driver {}, CUDA {}",
            *mib as f64 / 1024.0,
            inv.driver_version,
            inv.cuda_driver_version
        ));
    }
    let mig_on = inv.gpus.iter().filter(|g| g.mig.current).count();
    if mig_on > 0 {
        say.say(format!(
            "MIG on {mig_on} GPU(s): {} MIG device(s)",
            inv.mig_device_count()
        ));
    }
    let topology = facts::topology_line(inv);
    say.say(&topology);
    // Every unit (a GPU with MIG off, a MIG device) by UUID, as both APIs must offer it.
    let units: BTreeMap<String, String> = inv
        .dra_devices()
        .iter()
        .map(|d| (d.uuid().to_string(), d.dra_name()))
        .collect();
    let seen = poll(|| async {
        let ids = listed(cx.lab);
        let (slices, devices) = published(&cx.client).await?;
        let in_dp = units.keys().filter(|u| ids.contains_key(*u)).count();
        let uuids: BTreeSet<&str> = devices.iter().filter_map(|d| d.uuid.as_deref()).collect();
        let in_dra = units.keys().filter(|u| uuids.contains(u.as_str())).count();
        match in_dp == units.len() && in_dra == units.len() {
            true => Ok((slices.len(), devices.len())),
            false => Err(format!(
                "the device plugin lists {in_dp} and the ResourceSlices publish {in_dra} of the {} units",
                units.len()
            )),
        }
    })
    .await;
    match seen {
        Ok((slices, devices)) => {
            for (resource, view) in cx.lab.kubelet.plugins() {
                say.say(format!(
                    "kubelet, device plugin API (ListAndWatch): {resource}: {} devices, {} healthy",
                    view.devices.len(),
                    view.healthy()
                ));
            }
            say.say(format!(
                "API server, DRA: {devices} devices in {slices} ResourceSlice(s) of pool {NODE}"
            ));
            // GPU Feature Discovery's labels, written by the agent on its Node.
            let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(cx.client.clone());
            let labels = poll(|| {
                let nodes = nodes.clone();
                async move {
                    let n = nodes.get(NODE).await.map_err(|e| e.to_string())?;
                    let l = n.metadata.labels.unwrap_or_default();
                    match l.get("nvidia.com/gpu.count") {
                        Some(_) => Ok(l),
                        None => Err("no GPU labels on the node yet".to_string()),
                    }
                }
            })
            .await;
            match labels {
                Ok(l) => say.say(format!(
                    "node labels (as GPU Feature Discovery's): {}",
                    [
                        "gpu.product",
                        "gpu.count",
                        "gpu.memory",
                        "gpu.family",
                        "mig.capable"
                    ]
                    .iter()
                    .filter_map(|k| l
                        .get(&format!("nvidia.com/{k}"))
                        .map(|v| format!("nvidia.com/{k}={v}")))
                    .collect::<Vec<_>>()
                    .join(", ")
                )),
                Err(e) => return Outcome::Failed(format!("node labels: {e}")),
            }
            Outcome::Held(format!(
                "all {} units offered by both APIs; {topology}",
                units.len()
            ))
        }
        Err(e) => Outcome::Failed(e),
    }
}

async fn nvlink_allocation(cx: &Context<'_>, carry: &mut Carry, say: &mut Narrator<'_>) -> Outcome {
    let inv = cx.inventory;
    let available: Vec<String> = cx
        .lab
        .kubelet
        .plugin(GPU_RESOURCE)
        .map(|v| {
            v.devices
                .into_iter()
                .filter(|d| d.health == "Healthy")
                .map(|d| d.id)
                .collect()
        })
        .unwrap_or_default();
    if available.len() < REQUEST {
        return Outcome::Skipped(format!(
            "{} offers {} whole GPU(s) as {GPU_RESOURCE}; the request needs {REQUEST}",
            cx.profile,
            available.len()
        ));
    }
    if !facts::has_nvlink(inv) {
        return Outcome::Skipped(format!(
            "{} has no NVLink between its GPUs: there is no NVLink-optimal set to show",
            cx.profile
        ));
    }
    let preferred = match cx
        .lab
        .kubelet
        .preferred(GPU_RESOURCE, &available, &[], REQUEST)
        .await
    {
        Ok(p) => p,
        Err(s) => {
            return Outcome::Failed(format!("GetPreferredAllocation failed: {}", s.message()))
        }
    };
    let indices =
        |ids: &[String]| -> Option<Vec<u32>> { ids.iter().map(|id| gpu_index(inv, id)).collect() };
    let (Some(chosen), Some(pool)) = (indices(&preferred), indices(&available)) else {
        return Outcome::Failed(format!(
            "GetPreferredAllocation answered IDs that are not GPUs of the inventory: {}",
            list(&preferred)
        ));
    };
    let model = TopologyModel::new(inv);
    let score = model.set_score(&chosen);
    let Some(best) = facts::best_set_score(&model, &pool, REQUEST) else {
        return Outcome::Skipped(format!(
            "{} free GPUs: too many {REQUEST}-GPU sets to check the choice against every one",
            pool.len()
        ));
    };
    let (lanes, without) = facts::nvlinks_within(inv, &chosen);
    let numa: BTreeSet<String> = chosen
        .iter()
        .filter_map(|i| inv.gpu(*i))
        .map(|g| g.numa_node.map_or("?".to_string(), |n| n.to_string()))
        .collect();
    let gpus: Vec<String> = chosen.iter().map(|i| format!("GPU{i}")).collect();
    say.say(format!(
        "GetPreferredAllocation({REQUEST} of {} available) -> {}: {lanes} NVLink lanes over its {} pairs, {without} pair(s) without NVLink, NUMA node(s) {}",
        available.len(),
        list(&gpus),
        chosen.len() * (chosen.len() - 1) / 2,
        numa.into_iter().collect::<Vec<_>>().join(",")
    ));
    let admitted = cx
        .lab
        .kubelet
        .admit(NODE_NAMESPACE, "train-4gpu", "main", GPU_RESOURCE, REQUEST)
        .await;
    let (ids, grant) = match admitted {
        Ok(a) => a,
        Err(s) => return Outcome::Failed(format!("Allocate failed: {}", s.message())),
    };
    let cdi: Vec<String> = grant.cdi_devices.iter().map(|d| d.name.clone()).collect();
    say.say(format!(
        "pod {NODE_NAMESPACE}/train-4gpu admitted by the kubelet double: Allocate returned {} CDI device(s): {}",
        cdi.len(),
        list(&cdi)
    ));
    carry.pod_ids = ids.clone();
    let same: BTreeSet<&String> = ids.iter().collect();
    say.say(format!(
        "topology score of the set {score}; best of every {REQUEST}-GPU set of the available ones {best}"
    ));
    if same != preferred.iter().collect() {
        return Outcome::Failed(format!(
            "the pod got {} but the preferred set was {}",
            list(&ids),
            list(&preferred)
        ));
    }
    if best != score {
        return Outcome::Failed(format!(
            "{} scores {score}; the best set scores {best}",
            list(&gpus)
        ));
    }
    if cdi.len() != REQUEST {
        return Outcome::Failed(format!(
            "Allocate returned {} CDI devices for {REQUEST} GPUs",
            cdi.len()
        ));
    }
    Outcome::Held(format!(
        "{} allocated: {lanes} NVLink lanes, no other {REQUEST}-GPU set of the {} free scores higher",
        list(&gpus),
        available.len()
    ))
}

/// The CDI spec file under `cdi_root` that defines `id`, with its device names.
fn find_spec(
    cdi_root: &std::path::Path,
    id: &str,
) -> Result<(std::path::PathBuf, Vec<String>), String> {
    let (kind, name) =
        facts::split_cdi_id(id).ok_or_else(|| format!("{id} is not a CDI device id"))?;
    let entries =
        std::fs::read_dir(cdi_root).map_err(|e| format!("reading {}: {e}", cdi_root.display()))?;
    for e in entries.flatten() {
        let path = e.path();
        let Ok(text) = std::fs::read(&path) else {
            continue;
        };
        let Ok(spec) = serde_json::from_slice::<Value>(&text) else {
            continue;
        };
        let names: Vec<String> = spec["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| d["name"].as_str().map(str::to_string))
            .collect();
        if spec["kind"] == kind && names.iter().any(|n| n == name) {
            return Ok((path, names));
        }
    }
    Err(format!(
        "no CDI spec in {} defines {id}",
        cdi_root.display()
    ))
}

async fn dra_claim(cx: &Context<'_>, carry: &mut Carry, say: &mut Narrator<'_>) -> Outcome {
    let devices = match published(&cx.client).await {
        Ok((_, d)) => d,
        Err(e) => return Outcome::Failed(e),
    };
    let free = |d: &&PublishedDevice| {
        d.taints.is_empty() && d.uuid.as_ref().is_some_and(|u| !carry.pod_ids.contains(u))
    };
    // A whole GPU if one is free, else a MIG device.
    let Some(device) = devices
        .iter()
        .filter(free)
        .find(|d| d.kind.as_deref() == Some("gpu"))
        .or_else(|| devices.iter().find(free))
        .cloned()
    else {
        return Outcome::Failed("no free published device to claim".into());
    };
    let claim = match cx.lab.claim(NODE_NAMESPACE, "inference", &[&device.name]) {
        Ok(c) => c,
        Err(e) => return Outcome::Failed(e.to_string()),
    };
    say.say(format!(
        "ResourceClaim {NODE_NAMESPACE}/inference, allocated (as the scheduler would) to {} of pool {NODE}",
        device.name
    ));
    let prepared = match cx.lab.prepare(&claim).await {
        Ok(p) => p,
        Err(e) => return Outcome::Failed(format!("NodePrepareResources refused the claim: {e}")),
    };
    let ids: Vec<String> = prepared.iter().flat_map(|d| d.cdi_ids.clone()).collect();
    say.say(format!(
        "kubelet, DRA API: NodePrepareResources -> {} device(s), CDI ids {}",
        prepared.len(),
        list(&ids)
    ));
    let Some(first) = ids.first() else {
        return Outcome::Failed("NodePrepareResources returned no CDI device".into());
    };
    let cdi_root = cx.lab.paths().cdi_root;
    let (path, names) = match find_spec(&cdi_root, first) {
        Ok(found) => found,
        Err(e) => return Outcome::Failed(e),
    };
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    say.say(format!(
        "CDI spec {}: devices {}",
        path.display(),
        list(&names)
    ));
    let missing: Vec<&String> = ids
        .iter()
        .filter(|id| facts::split_cdi_id(id).is_none_or(|(_, n)| !names.iter().any(|x| x == n)))
        .collect();
    if !missing.is_empty() || prepared.iter().any(|d| d.device != device.name) {
        return Outcome::Failed(format!(
            "prepared {:?} for {}; CDI ids not in {file}: {missing:?}",
            prepared.iter().map(|d| &d.device).collect::<Vec<_>>(),
            device.name
        ));
    }
    // The claim's status.devices, as `kubectl get resourceclaim -o yaml` shows it.
    let claims: Api<ResourceClaim> = Api::namespaced(cx.client.clone(), &claim.namespace);
    let entry = poll(|| {
        let (claims, name, dev) = (claims.clone(), claim.name.clone(), device.name.clone());
        async move {
            let c = claims.get(&name).await.map_err(|e| e.to_string())?;
            c.status
                .and_then(|s| s.devices)
                .into_iter()
                .flatten()
                .find(|d| d.device == dev)
                .ok_or_else(|| format!("no status.devices entry for {dev} yet"))
        }
    })
    .await;
    let entry = match entry {
        Ok(e) => e,
        Err(e) => return Outcome::Failed(format!("the claim's status.devices: {e}")),
    };
    let ready = entry
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let uuid = entry
        .data
        .as_ref()
        .and_then(|d| d.0.get("uuid"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    say.say(format!(
        "claim status.devices: {} {} (uuid {uuid})",
        entry.device,
        if ready { "Ready" } else { "not Ready" }
    ));
    if !ready || device.uuid.as_deref() != Some(uuid.as_str()) {
        return Outcome::Failed(format!(
            "status.devices of {} says ready={ready}, uuid {uuid:?}, not {:?}",
            device.name, device.uuid
        ));
    }
    let held = format!(
        "claim {}/{} prepared on {}; CDI spec {file}, {} device(s); status.devices Ready",
        claim.namespace,
        claim.name,
        device.name,
        names.len()
    );
    carry.claim = Some((claim, device));
    Outcome::Held(held)
}

async fn ledger_refusal(cx: &Context<'_>, carry: &mut Carry, say: &mut Narrator<'_>) -> Outcome {
    let Some((claim, device)) = carry.claim.clone() else {
        return Outcome::Failed("needs the claim of the previous step, which did not hold".into());
    };
    let Some(uuid) = device.uuid.clone() else {
        return Outcome::Failed(format!("{} is published without a uuid", device.name));
    };
    // The device plugin side first withdraws the claimed device from ListAndWatch...
    let withdrawn = poll(|| async {
        match listed(cx.lab).get(&uuid) {
            Some((resource, health)) if health == "Unhealthy" => Ok(resource.clone()),
            Some((_, health)) => Err(format!("ListAndWatch still lists {uuid} as {health}")),
            None => Err(format!("no device-plugin resource lists {uuid}")),
        }
    })
    .await;
    let resource = match withdrawn {
        Ok(r) => r,
        Err(e) => return Outcome::Failed(e),
    };
    say.say(format!(
        "ListAndWatch now lists {} ({resource} {uuid}) as Unhealthy: withdrawn while the claim holds it",
        device.name
    ));
    // ...and an Allocate that still asks for it (a kubelet with a stale list) is refused.
    let holder = format!("ResourceClaim {}/{}", claim.namespace, claim.name);
    let refusal = match cx
        .lab
        .kubelet
        .allocate(&resource, std::slice::from_ref(&uuid))
        .await
    {
        Ok(_) => return Outcome::Failed(format!("Allocate granted {uuid}, which {holder} holds")),
        Err(s) => s.message().to_string(),
    };
    say.say(format!(
        "device plugin Allocate({uuid}) -> refused: {refusal}"
    ));
    if !refusal.contains(&holder) {
        return Outcome::Failed(format!("the refusal does not name {holder}: {refusal}"));
    }
    let mut evidence = format!("Allocate of {} refused, naming {holder}", device.name);

    // The other direction: a claim for a device a container holds through the device plugin
    // (the 4-GPU pod's, or one admitted now where the machine could not show that step).
    if carry.pod_ids.is_empty() {
        let free = listed(cx.lab)
            .into_iter()
            .find(|(id, (_, health))| health == "Healthy" && *id != uuid);
        if let Some((_, (resource, _))) = free {
            match cx
                .lab
                .kubelet
                .admit(NODE_NAMESPACE, "small", "main", &resource, 1)
                .await
            {
                Ok((ids, _)) => {
                    say.say(format!(
                        "pod {NODE_NAMESPACE}/small admitted by the kubelet double: 1 x {resource} {}",
                        list(&ids)
                    ));
                    carry.pod_ids = ids;
                }
                Err(s) => return Outcome::Failed(format!("Allocate failed: {}", s.message())),
            }
        }
    }
    if let Some(taken) = carry.pod_ids.first() {
        let devices = match published(&cx.client).await {
            Ok((_, d)) => d,
            Err(e) => return Outcome::Failed(e),
        };
        let Some(target) = devices.iter().find(|d| d.uuid.as_ref() == Some(taken)) else {
            return Outcome::Failed(format!("{taken} is not published"));
        };
        let steal = match cx.lab.claim(NODE_NAMESPACE, "late", &[&target.name]) {
            Ok(c) => c,
            Err(e) => return Outcome::Failed(e.to_string()),
        };
        let refusal = match cx.lab.prepare(&steal).await {
            Ok(_) => {
                return Outcome::Failed(format!(
                    "NodePrepareResources granted {}, which a device-plugin pod holds",
                    target.name
                ))
            }
            Err(e) => e,
        };
        say.say(format!(
            "ResourceClaim {NODE_NAMESPACE}/late for {}: NodePrepareResources -> refused: {refusal}",
            target.name
        ));
        if !refusal.contains(taken.as_str()) || !refusal.contains("held by") {
            return Outcome::Failed(format!(
                "the refusal does not name the device-plugin holder of {taken}: {refusal}"
            ));
        }
        evidence.push_str(&format!(
            "; NodePrepare of {} refused, naming the device-plugin holder",
            target.name
        ));
    }
    Outcome::Held(evidence)
}

fn gpu_pod(namespace: &str, name: &str, gpus: u32) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": format!("uid-{namespace}-{name}")},
        "spec": {"containers": [{"name": "main", "image": "cuda",
            "resources": {"limits": {GPU_RESOURCE: gpus.to_string()}}}]}
    })
}

/// The webhook's verdict on `pod`: (allowed, message, base64 patch).
async fn review(
    cx: &Context<'_>,
    path: &str,
    pod: &Value,
) -> Result<(bool, String, Option<String>), String> {
    let name = pod["metadata"]["name"].as_str().unwrap_or_default();
    let (status, answer) = cx
        .pki
        .post_json(
            cx.webhook,
            path,
            &pod_create_review(&format!("review-{name}"), pod),
        )
        .await
        .map_err(|e| e.to_string())?;
    let r = &answer["response"];
    if status != 200 || r["uid"] != format!("review-{name}") {
        return Err(format!("the webhook answered {status}: {answer}"));
    }
    Ok((
        r["allowed"] == true,
        r["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        r["patch"].as_str().map(str::to_string),
    ))
}

async fn quota(cx: &Context<'_>, say: &mut Narrator<'_>) -> Outcome {
    let ns = REJECT_NAMESPACE;
    say.say(format!(
        "GpuQuota {ns}/{QUOTA_NAME}: hard gpus {REJECT_GPUS}, mode Reject; AdmissionReviews over HTTPS to {}",
        cx.webhook
    ));
    let a = gpu_pod(ns, "pod-a", REJECT_GPUS as u32);
    let b = gpu_pod(ns, "pod-b", 1);
    let (a_ok, a_msg, _) = match review(cx, "/validate", &a).await {
        Ok(v) => v,
        Err(e) => return Outcome::Failed(e),
    };
    say.say(format!(
        "pod-a asks for {REJECT_GPUS} x {GPU_RESOURCE} -> {}",
        if a_ok {
            "allowed".to_string()
        } else {
            format!("denied: {a_msg}")
        }
    ));
    let (b_ok, b_msg, _) = match review(cx, "/validate", &b).await {
        Ok(v) => v,
        Err(e) => return Outcome::Failed(e),
    };
    say.say(format!(
        "pod-b asks for 1 x {GPU_RESOURCE} -> {}",
        if b_ok {
            "allowed".to_string()
        } else {
            format!("denied: {b_msg}")
        }
    ));
    let q = match Api::<GpuQuota>::namespaced(cx.client.clone(), ns)
        .get(QUOTA_NAME)
        .await
    {
        Ok(q) => q,
        Err(e) => return Outcome::Failed(format!("reading GpuQuota {ns}/{QUOTA_NAME}: {e}")),
    };
    let status = q.status.unwrap_or_default();
    let reserved: Vec<String> = status
        .reservations
        .iter()
        .filter(|r| r.state == ReservationState::Reserved)
        .map(|r| r.name.clone())
        .collect();
    say.say(format!(
        "GpuQuota status: reserved gpus {}, reservations [{}]",
        status.reserved.gpus,
        list(&reserved)
    ));
    match (a_ok, b_ok) {
        (true, false) if !b_msg.is_empty() && reserved == ["pod-a"] => {
            Outcome::Held(format!("pod-a allowed and reserved; pod-b denied: {b_msg}"))
        }
        (true, false) => Outcome::Failed(format!(
            "pod-b denied ({b_msg:?}) but the quota reserves [{}]",
            list(&reserved)
        )),
        _ => Outcome::Failed(format!(
            "pod-a {}, pod-b {} (expected allowed, denied)",
            if a_ok { "allowed" } else { "denied" },
            if b_ok { "allowed" } else { "denied" }
        )),
    }
}

fn gated(p: &Pod) -> bool {
    p.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == SCHEDULING_GATE))
}

/// The `QuotaAdmitted` condition of a pod: (status, message).
fn admitted_condition(p: &Pod) -> Option<(String, String)> {
    p.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "QuotaAdmitted")
        .map(|c| (c.status.clone(), c.message.clone().unwrap_or_default()))
}

async fn pod_group(cx: &Context<'_>, say: &mut Narrator<'_>) -> Outcome {
    let ns = QUEUE_NAMESPACE;
    let pods: Api<Pod> = Api::namespaced(cx.client.clone(), ns);
    let members: Vec<String> = (0..QUEUE_GPUS).map(|i| format!("train-{i}")).collect();
    say.say(format!(
        "GpuQuota {ns}/{QUOTA_NAME}: hard gpus {QUEUE_GPUS}, mode Queue; a 2-GPU pod `warmup` already runs"
    ));
    // Already running (bound to the node): it holds half the quota.
    let mut warmup = gpu_pod(ns, "warmup", 2);
    warmup["spec"]["nodeName"] = json!(NODE);
    let create = |pod: Value| {
        let pods = pods.clone();
        async move {
            let pod: Pod = serde_json::from_value(pod).map_err(|e| e.to_string())?;
            pods.create(&PostParams::default(), &pod)
                .await
                .map_err(|e| e.to_string())
        }
    };
    if let Err(e) = create(warmup).await {
        return Outcome::Failed(format!("creating pod warmup: {e}"));
    }
    // The group: each member goes through the mutating webhook (which gates it), the
    // validating one, and is created with the patch applied, as the API server does.
    for name in &members {
        let mut pod = gpu_pod(ns, name, 1);
        pod["metadata"]["labels"] = json!({GROUP_LABEL: "train"});
        pod["metadata"]["annotations"] = json!({GROUP_SIZE_ANNOTATION: members.len().to_string()});
        match review(cx, "/mutate", &pod).await {
            Ok((true, _, Some(patch))) => {
                if let Err(e) = facts::apply_review_patch(&mut pod, &patch) {
                    return Outcome::Failed(format!("{name}: {e}"));
                }
            }
            Ok((true, _, None)) => {
                return Outcome::Failed(format!("the mutating webhook did not gate {name}"))
            }
            Ok((false, msg, _)) => {
                return Outcome::Failed(format!("{name} denied at mutation: {msg}"))
            }
            Err(e) => return Outcome::Failed(e),
        }
        match review(cx, "/validate", &pod).await {
            Ok((true, _, _)) => {}
            Ok((false, msg, _)) => return Outcome::Failed(format!("{name} denied: {msg}")),
            Err(e) => return Outcome::Failed(e),
        }
        match create(pod).await {
            Ok(p) if gated(&p) => {}
            Ok(_) => return Outcome::Failed(format!("{name} was created without the gate")),
            Err(e) => return Outcome::Failed(format!("creating {name}: {e}")),
        }
    }
    say.say(format!(
        "pod group `train` of {} x 1 GPU created through the webhooks: each got the scheduling gate {SCHEDULING_GATE}",
        members.len()
    ));
    let waiting = poll(|| async {
        let mut notes = Vec::new();
        for name in &members {
            let p = pods.get(name).await.map_err(|e| e.to_string())?;
            match admitted_condition(&p) {
                Some((s, m)) if s == "False" && gated(&p) => notes.push(m),
                other => return Err(format!("{name}: gated {}, condition {other:?}", gated(&p))),
            }
        }
        Ok(notes)
    })
    .await;
    let note = match waiting {
        Ok(notes) => notes.into_iter().next().unwrap_or_default(),
        Err(e) => return Outcome::Failed(format!("the group did not wait: {e}")),
    };
    say.say(format!(
        "the controller holds all {} gated: {note}",
        members.len()
    ));

    cx.lab.api.clear_requests();
    let released_before = cx.queue.snapshot().released;
    if let Err(e) = pods.delete("warmup", &DeleteParams::default()).await {
        return Outcome::Failed(format!("deleting warmup: {e}"));
    }
    say.say("warmup finishes (deleted): 2 GPUs free up");
    let released = poll(|| async {
        let now = pods
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let still: Vec<String> = now
            .items
            .iter()
            .filter(|p| gated(p))
            .filter_map(|p| p.metadata.name.clone())
            .collect();
        match still.is_empty() {
            true => Ok(()),
            false => Err(format!("still gated: {}", list(&still))),
        }
    })
    .await;
    if let Err(e) = released {
        return Outcome::Failed(format!("the group was not released: {e}"));
    }
    // One controller cycle: the gate removals follow each other with no fresh read of the
    // quotas (which starts every cycle) between them.
    let log = cx.lab.api.requests();
    let gates: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, (m, p))| {
            m == "PATCH"
                && p.contains(&format!("/namespaces/{ns}/pods/train-"))
                && !p.contains("/status")
        })
        .map(|(i, _)| i)
        .collect();
    let (Some(first), Some(last)) = (gates.first(), gates.last()) else {
        return Outcome::Failed("no gate removal in the API server's request log".into());
    };
    let cycles_between = log[*first..*last]
        .iter()
        .filter(|(m, p)| m == "GET" && p.contains("/gpuquotas") && !p.contains("watch"))
        .count();
    // The loop counts its releases once every gate removal of the cycle has answered, a
    // moment after the last pod shows ungated.
    let want = members.len() as u64;
    let counted = poll(|| async {
        let n = cx.queue.snapshot().released.saturating_sub(released_before);
        if n >= want {
            Ok(n)
        } else {
            Err(format!("{n} releases counted"))
        }
    })
    .await;
    let count = match counted {
        Ok(n) => n,
        Err(e) => return Outcome::Failed(format!("the controller's release counter: {e}")),
    };
    say.say(format!(
        "the controller removed {} gates (PATCH) with {cycles_between} quota reads between them; it counts {count} releases",
        gates.len()
    ));
    match (gates.len() == members.len(), cycles_between) {
        (true, 0) => Outcome::Held(format!(
            "{} members held together ({}), then released in one controller cycle",
            members.len(),
            note.rsplit(": ").next().unwrap_or_default()
        )),
        _ => Outcome::Failed(format!(
            "{} gate removals spread over {} cycles",
            gates.len(),
            cycles_between + 1
        )),
    }
}

async fn xid_health(cx: &Context<'_>, carry: &mut Carry, say: &mut Narrator<'_>) -> Outcome {
    let devices = match published(&cx.client).await {
        Ok((_, d)) => d,
        Err(e) => return Outcome::Failed(e),
    };
    let dp = listed(cx.lab);
    let claimed = carry.claim.as_ref().map(|(_, d)| d.name.clone());
    // A device nobody holds: healthy in ListAndWatch and untainted in its slice.
    let target = devices.iter().find(|d| {
        d.taints.is_empty()
            && Some(&d.name) != claimed.as_ref()
            && d.uuid.as_ref().is_some_and(|u| {
                !carry.pod_ids.contains(u) && dp.get(u).is_some_and(|(_, h)| h == "Healthy")
            })
    });
    let Some((device, uuid)) = target.and_then(|d| Some((d.name.clone(), d.uuid.clone()?))) else {
        return Outcome::Failed("no free, healthy device to inject an Xid into".into());
    };
    let (gpu_uuid, mig_uuid) = match cx.inventory.dra_device(&device) {
        Some(DeviceRef::Gpu(g)) => (g.uuid.clone(), None),
        Some(DeviceRef::Mig { parent, mig }) => (parent.uuid.clone(), Some(mig.uuid.clone())),
        None => return Outcome::Failed(format!("{device} is not in the inventory")),
    };
    let injected = Instant::now();
    cx.lab.sim.inject_xid(&gpu_uuid, mig_uuid.as_ref(), XID);
    say.say(format!("the driver reports Xid {XID} on {device} ({uuid})"));
    let state = |want_unhealthy: bool| {
        let (device, uuid) = (device.clone(), uuid.clone());
        async move {
            let (_, devices) = published(&cx.client).await?;
            let taints: Vec<String> = devices
                .iter()
                .find(|d| d.name == device)
                .map(|d| d.taints.clone())
                .unwrap_or_default();
            let tainted: Vec<String> = taints
                .into_iter()
                .filter(|t| t.starts_with(&format!("{UNHEALTHY_TAINT_KEY}=")))
                .collect();
            let dp_health = listed(cx.lab)
                .get(&uuid)
                .map(|(_, h)| h.clone())
                .unwrap_or_default();
            let dra_health = cx
                .lab
                .dra
                .health(crate::doubles::lab::DRIVER)
                .and_then(|h| h.health(NODE, &device));
            let want = if want_unhealthy {
                "Unhealthy"
            } else {
                "Healthy"
            };
            let want_dra = if want_unhealthy {
                HealthStatus::Unhealthy
            } else {
                HealthStatus::Healthy
            };
            match (
                tainted.is_empty() != want_unhealthy,
                dp_health == want,
                dra_health == Some(want_dra),
            ) {
                (true, true, true) => Ok((tainted, dp_health, dra_health)),
                _ => Err(format!(
                    "taints {tainted:?}, ListAndWatch {dp_health:?}, DRA health {dra_health:?}"
                )),
            }
        }
    };
    let (taints, dp_health, dra_health) = match poll(|| state(true)).await {
        Ok(s) => s,
        Err(e) => return Outcome::Failed(format!("{device} did not turn unhealthy: {e}")),
    };
    let sick_after = injected.elapsed();
    say.say(format!(
        "after {:.1} s: ResourceSlice taint {}, ListAndWatch {dp_health}, DRA health stream {}",
        sick_after.as_secs_f64(),
        list(&taints),
        dra_health.map_or("silent".to_string(), |h| format!("{h:?}"))
    ));
    if let Err(e) = poll(|| state(false)).await {
        return Outcome::Failed(format!("{device} did not recover: {e}"));
    }
    let healthy_after = injected.elapsed();
    let quiet = super::RECOVERY_QUIET_PERIOD;
    say.say(format!(
        "after {:.1} s without another Xid (quiet period {} s): taint gone, ListAndWatch Healthy, DRA health Healthy",
        healthy_after.as_secs_f64(),
        quiet.as_secs()
    ));
    if healthy_after < quiet {
        return Outcome::Failed(format!(
            "{device} recovered after {healthy_after:?}, before the quiet period of {quiet:?}"
        ));
    }
    Outcome::Held(format!(
        "Xid {XID} on {device}: tainted and Unhealthy in both APIs after {:.1} s, healthy again after {:.1} s",
        sick_after.as_secs_f64(),
        healthy_after.as_secs_f64()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pod_reviews_pass_the_webhooks_strict_decoding() {
        let pod = gpu_pod("team-a", "p", 2);
        let body = serde_json::to_vec(&pod_create_review("u-1", &pod)).unwrap_or_default();
        let req = gpuplane_shell::webhook::review::decode(&body).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(req.uid, "u-1");
        assert_eq!(req.operation, "CREATE");
        assert_eq!(req.namespace.as_deref(), Some("team-a"));
        let p: Pod = serde_json::from_value(pod).unwrap_or_else(|e| panic!("{e}"));
        assert!(!gated(&p));
    }
}
