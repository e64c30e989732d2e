use super::*;
use crate::quota::CatalogSettings;
use k8s_openapi::api::resource::v1::{
    DeviceClass, ResourceClaim, ResourceClaimTemplate, ResourceSlice,
};
use serde_json::{json, Value};

fn pod(name: &str, gpus: u64, extra: Value) -> Pod {
    let mut p = json!({
        "metadata": {"namespace": "team-a", "name": name},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]},
        "status": {"phase": "Pending"},
    });
    merge(&mut p, extra);
    serde_json::from_value(p).unwrap()
}

fn merge(a: &mut Value, b: Value) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

fn node(name: &str, gpus: u64, extra: Value) -> Node {
    let mut n = json!({
        "metadata": {"name": name, "labels": {"pool": "a"}},
        "spec": {},
        "status": {
            "allocatable": {"nvidia.com/gpu": gpus.to_string(), "cpu": "64"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    });
    merge(&mut n, extra);
    serde_json::from_value(n).unwrap()
}

fn running(name: &str, node: &str, gpus: u64) -> Pod {
    pod(
        name,
        gpus,
        json!({"spec": {"nodeName": node}, "status": {"phase": "Running"}}),
    )
}

fn answer(p: &Pod, nodes: &[Node], pods: &[Pod]) -> (Reason, String) {
    let listed = Listed {
        nodes: nodes.to_vec(),
        pods: pods.to_vec(),
        ..Default::default()
    };
    answer_in(p, &listed)
}

fn answer_in(p: &Pod, listed: &Listed) -> (Reason, String) {
    let e = explain(p, &Cluster::new(listed, CatalogSettings::default()));
    (e.reason, e.message)
}

#[test]
fn too_few_free_in_the_cluster_is_capacity_with_the_numbers() {
    let nodes = [node("a", 8, json!({}))];
    let pods = [running("r", "a", 5)];
    let (r, m) = answer(&pod("p", 4, json!({})), &nodes, &pods);
    assert_eq!(r, Reason::Capacity);
    assert_eq!(m, "needs 4 nvidia.com/gpu; 3 free in the cluster");
}

#[test]
fn enough_in_total_but_not_on_one_node_is_fragmentation_naming_each_node() {
    let nodes = [
        node("a", 4, json!({})),
        node("b", 4, json!({})),
        node("c", 4, json!({})),
    ];
    let pods = [
        running("x", "a", 2),
        running("y", "b", 2),
        running("z", "c", 2),
    ];
    let (r, m) = answer(&pod("p", 4, json!({})), &nodes, &pods);
    assert_eq!(r, Reason::Fragmentation);
    assert_eq!(
        m,
        "needs 4 nvidia.com/gpu; 6 free across 3 nodes, at most 2 on one: a 2, b 2, c 2"
    );
}

#[test]
fn free_gpus_only_on_nodes_the_pod_may_not_use_is_placement_naming_the_taint_or_label() {
    let tainted =
        json!({"spec": {"taints": [{"key": "drain", "value": "b", "effect": "NoSchedule"}]}});
    let nodes = [node("a", 8, json!({})), node("b", 8, tainted)];
    let pods = [running("x", "a", 8)];
    let (r, m) = answer(&pod("p", 4, json!({})), &nodes, &pods);
    assert_eq!(r, Reason::Placement);
    assert!(
        m.contains("b: taint drain=b:NoSchedule not tolerated"),
        "{m}"
    );
    // Tolerated, it fits: no reason of ours.
    let tolerant = pod(
        "p",
        4,
        json!({"spec": {"tolerations": [{"key": "drain", "operator": "Exists"}]}}),
    );
    assert_eq!(answer(&tolerant, &nodes, &pods).0, Reason::Unknown);
    // A node selector the free node lacks.
    let nodes = [
        node("a", 8, json!({})),
        node("b", 8, json!({"metadata": {"labels": {"pool": "b"}}})),
    ];
    let picky = pod("p", 4, json!({"spec": {"nodeSelector": {"pool": "b"}}}));
    let (r, m) = answer(&picky, &nodes, &[running("y", "b", 8)]);
    assert_eq!(r, Reason::Placement);
    assert!(m.contains("a: nodeSelector pool=b not matched"), "{m}");
}

#[test]
fn pods_classified_in_one_cycle_get_the_answers_each_would_get_alone() {
    // One cluster answers pods alike once; whatever placement rule differs must not share it.
    let tainted =
        json!({"spec": {"taints": [{"key": "drain", "value": "b", "effect": "NoSchedule"}]}});
    let nodes = vec![
        node("a", 8, json!({})),
        node("b", 8, tainted),
        node("c", 4, json!({"metadata": {"labels": {"pool": "c"}}})),
    ];
    let pods = vec![running("x", "a", 8)];
    let affinity = |op: &str| {
        json!({"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": op, "values": ["c"]}]}]
        }}}}})
    };
    let asked = [
        pod("p1", 6, json!({})),
        pod("p2", 6, json!({})),
        pod(
            "p3",
            6,
            json!({"spec": {"tolerations": [{"key": "drain", "operator": "Exists"}]}}),
        ),
        pod("p4", 2, json!({})),
        pod("p5", 6, json!({"spec": {"nodeSelector": {"pool": "c"}}})),
        pod("p6", 2, affinity("In")),
        pod("p7", 2, affinity("NotIn")),
        pod("p8", 20, json!({})),
    ];
    let listed = Listed {
        nodes,
        pods,
        ..Default::default()
    };
    let shared = Cluster::new(&listed, CatalogSettings::default());
    let together: Vec<_> = asked.iter().map(|p| explain(p, &shared)).collect();
    for (p, e) in asked.iter().zip(&together) {
        assert_eq!(
            (e.reason, e.message.clone()),
            answer_in(p, &listed),
            "{e:?}"
        );
    }
    let reasons: Vec<Reason> = together.iter().map(|e| e.reason).collect();
    use Reason::*;
    assert_eq!(
        reasons,
        [Placement, Placement, Unknown, Unknown, Placement, Unknown, Placement, Capacity]
    );
}

#[test]
fn required_node_affinity_is_evaluated_as_kubernetes_does() {
    let affinity = |op: &str, values: Value| {
        pod(
            "p",
            1,
            json!({"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": op, "values": values}]}]
            }}}}}),
        )
    };
    let nodes = [node("a", 1, json!({}))];
    assert_eq!(
        answer(&affinity("In", json!(["a"])), &nodes, &[]).0,
        Reason::Unknown
    );
    assert_eq!(
        answer(&affinity("NotIn", json!(["a"])), &nodes, &[]).0,
        Reason::Placement
    );
    assert_eq!(
        answer(&affinity("DoesNotExist", json!([])), &nodes, &[]).0,
        Reason::Placement
    );
    assert_eq!(
        answer(&affinity("Exists", json!([])), &nodes, &[]).0,
        Reason::Unknown
    );
}

#[test]
fn no_node_offering_the_resource_is_no_gpu_capacity_and_not_ready_nodes_do_not_count() {
    let (r, m) = answer(&pod("p", 1, json!({})), &[node("cpu", 0, json!({}))], &[]);
    assert_eq!(r, Reason::NoGpuCapacity);
    assert!(
        m.starts_with("needs 1 nvidia.com/gpu; no node offers nvidia.com/gpu"),
        "{m}"
    );
    let down = node(
        "a",
        8,
        json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
    );
    let (r, m) = answer(&pod("p", 1, json!({})), &[down], &[]);
    assert_eq!(r, Reason::Capacity);
    assert_eq!(
        m,
        "needs 1 nvidia.com/gpu; 0 free in the cluster (1 node(s) offering it are not Ready or cordoned)"
    );
}

#[test]
fn a_gated_pod_is_held_by_quota_with_the_controllers_note() {
    let gated = pod(
        "p",
        1,
        json!({
            "spec": {"schedulingGates": [{"name": crate::quota::SCHEDULING_GATE}]},
            "status": {"conditions": [{"type": CONDITION, "status": "False", "message": "GpuQuota team-a/gold: gpus 2/2 used"}]},
        }),
    );
    let (r, m) = answer(&gated, &[node("a", 8, json!({}))], &[]);
    assert_eq!(r, Reason::Quota);
    assert_eq!(m, "held by GPU quota: GpuQuota team-a/gold: gpus 2/2 used");
}

#[test]
fn what_it_cannot_classify_it_says_so_quoting_the_scheduler() {
    let with_claim = pod(
        "p",
        0,
        json!({
            "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]},
            "status": {"conditions": [{"type": "PodScheduled", "status": "False", "message": "0/1 nodes are available"}]},
        }),
    );
    let (r, m) = answer(&with_claim, &[node("a", 8, json!({}))], &[]);
    assert_eq!(r, Reason::Unknown);
    assert!(
        m.ends_with("the scheduler says: \"0/1 nodes are available\""),
        "{m}"
    );
    // A scheduled, finished or GPU-less pod is not waiting for a GPU.
    let scheduled = running("r", "a", 1);
    assert_eq!(answer(&scheduled, &[], &[]).0, Reason::NotWaiting);
    assert_eq!(
        answer(&pod("p", 0, json!({})), &[], &[]).0,
        Reason::NotWaiting
    );
}

/// Right after the quota controller lifts its gate, the pod still carries the API server's
/// `SchedulingGated` condition until the scheduler's first attempt: that is a reason of its
/// own, not the scheduler's stale words. With another gate still on, the words are current.
#[test]
fn a_pod_just_released_from_its_gates_is_scheduling_not_unknown() {
    let gated_condition = json!({"type": "PodScheduled", "status": "False",
        "reason": "SchedulingGated", "message": "Scheduling is blocked due to non-empty scheduling gates"});
    let released = pod(
        "p",
        1,
        json!({"status": {"conditions": [gated_condition.clone()]}}),
    );
    let nodes = [node("a", 8, json!({}))];
    let (r, m) = answer(&released, &nodes, &[]);
    assert_eq!(r, Reason::Scheduling, "{m}");
    assert!(m.contains("released from its scheduling gates"), "{m}");
    let still_gated = pod(
        "p",
        1,
        json!({"spec": {"schedulingGates": [{"name": "example.com/other"}]},
            "status": {"conditions": [gated_condition]}}),
    );
    let (r, m) = answer(&still_gated, &nodes, &[]);
    assert_eq!(r, Reason::Unknown, "{m}");
    assert!(m.contains("non-empty scheduling gates"), "{m}");
    assert_eq!(Reason::parse("Scheduling"), Some(Reason::Scheduling));
}

#[test]
fn finished_pods_free_their_gpus() {
    let done = pod(
        "d",
        8,
        json!({"spec": {"nodeName": "a"}, "status": {"phase": "Succeeded"}}),
    );
    let (r, _) = answer(&pod("p", 8, json!({})), &[node("a", 8, json!({}))], &[done]);
    assert_eq!(
        r,
        Reason::Unknown,
        "8 free on a: the scheduler will place it"
    );
}

const D: &str = "gpu.gpuplane.dev";

fn slice(node: &str, product: &str, n: usize) -> ResourceSlice {
    let devices: Vec<Value> = (0..n)
        .map(|i| json!({"name": format!("gpu-{i}"), "attributes": {"type": {"string": "gpu"}, "productName": {"string": product}}}))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"name": format!("{node}-{D}")},
        "spec": {"driver": D, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}, "devices": devices}
    }))
    .unwrap()
}

fn gpu_class() -> DeviceClass {
    serde_json::from_value(json!({
        "metadata": {"name": D},
        "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{D}'")}}]}
    }))
    .unwrap()
}

fn template(count: u32, class: &str, expr: Option<&str>) -> ResourceClaimTemplate {
    let mut exactly = json!({"deviceClassName": class, "count": count});
    if let Some(e) = expr {
        exactly["selectors"] = json!([{"cel": {"expression": e}}]);
    }
    serde_json::from_value(json!({
        "metadata": {"namespace": "team-a", "name": "t"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}
    }))
    .unwrap()
}

/// A claim holding `devices` (pool, device) of driver D.
fn allocated(uid: &str, devices: &[(&str, &str)]) -> ResourceClaim {
    let results: Vec<Value> = devices
        .iter()
        .map(|(pool, d)| json!({"request": "gpu", "driver": D, "pool": pool, "device": d}))
        .collect();
    serde_json::from_value(json!({
        "metadata": {"namespace": "team-a", "name": uid, "uid": uid},
        "spec": {},
        "status": {"allocation": {"devices": {"results": results}}}
    }))
    .unwrap()
}

fn claim_pod() -> Pod {
    pod(
        "p",
        0,
        json!({"metadata": {"uid": "pod-uid"}, "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]}}),
    )
}

fn listed(t: ResourceClaimTemplate, claims: Vec<ResourceClaim>) -> Listed {
    Listed {
        slices: vec![
            slice("a", "NVIDIA A100-SXM4-80GB", 2),
            slice("b", "NVIDIA A100-SXM4-80GB", 2),
        ],
        classes: vec![gpu_class()],
        claims,
        templates: vec![t],
        ..Default::default()
    }
}

#[test]
fn a_request_no_published_device_matches_is_selector_naming_what_exists() {
    let want_h100 = format!("device.attributes['{D}'].productName == 'H100'");
    let l = listed(template(1, D, Some(&want_h100)), vec![]);
    let (r, m) = answer_in(&claim_pod(), &l);
    assert_eq!(r, Reason::Selector);
    assert_eq!(
        m,
        format!("request gpu: no device of DeviceClass {D} matches {want_h100}; this cluster has NVIDIA A100-SXM4-80GB x 4")
    );
    let (r, m) = answer_in(&claim_pod(), &listed(template(1, "nope", None), vec![]));
    assert_eq!(
        (r, m.as_str()),
        (
            Reason::Selector,
            "request gpu: DeviceClass nope does not exist"
        )
    );
    // An expression that cannot be evaluated may match: no confident answer.
    let odd = listed(
        template(1, D, Some("device.attributes['x'].y.z > 3")),
        vec![],
    );
    assert_eq!(answer_in(&claim_pod(), &odd).0, Reason::Unknown);
}

#[test]
fn too_few_matching_devices_free_is_capacity_and_spread_thin_is_fragmentation() {
    let taken = allocated("c1", &[("a", "gpu-0"), ("a", "gpu-1"), ("b", "gpu-0")]);
    let (r, m) = answer_in(&claim_pod(), &listed(template(2, D, None), vec![taken]));
    assert_eq!(r, Reason::Capacity);
    assert_eq!(m, format!("request gpu needs 2 device(s) of DeviceClass {D}; 1 of the 4 matching free in the cluster"));
    let taken = allocated("c1", &[("a", "gpu-0"), ("b", "gpu-0")]);
    let (r, m) = answer_in(&claim_pod(), &listed(template(2, D, None), vec![taken]));
    assert_eq!(r, Reason::Fragmentation);
    assert_eq!(
        m,
        format!("request gpu needs 2 device(s) of DeviceClass {D}; 2 free across 2 pools, at most 1 on one: a 1, b 1")
    );
    // Devices its own claim holds are its own.
    let mine = allocated("pod-uid", &[("a", "gpu-0"), ("a", "gpu-1"), ("b", "gpu-0")]);
    let (r, _) = answer_in(&claim_pod(), &listed(template(2, D, None), vec![mine]));
    assert_eq!(r, Reason::Unknown);
}

#[test]
fn pods_of_one_template_share_an_answer_but_a_pod_holding_devices_gets_its_own() {
    let mine = allocated("pod-uid", &[("a", "gpu-0"), ("a", "gpu-1"), ("b", "gpu-0")]);
    let cluster = Cluster::new(
        &listed(template(2, D, None), vec![mine]),
        CatalogSettings::default(),
    );
    let other = |n: &str| {
        let mut p = claim_pod();
        p.metadata.name = Some(n.into());
        p.metadata.uid = Some(format!("{n}-uid"));
        p
    };
    // Asked in both orders within one cluster: the memoised answer of pods without devices
    // never reaches the pod whose claim holds three of them.
    for first in [true, false] {
        if first {
            assert_eq!(explain(&other("x"), &cluster).reason, Reason::Capacity);
        }
        assert_eq!(explain(&claim_pod(), &cluster).reason, Reason::Unknown);
        let (x, y) = (
            explain(&other("x"), &cluster),
            explain(&other("y"), &cluster),
        );
        assert_eq!((x.reason, &x.message), (Reason::Capacity, &y.message));
    }
}
#[path = "tests_health.rs"]
mod health;
mod pending;
