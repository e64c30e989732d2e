//! The Unhealthy and Topology answers.

use super::*;

/// `slice(node, A100, n)` with GPU i on NUMA node `i / (n / 2)` and `taints` on named devices.
fn numa_slice(node: &str, n: usize, taints: &[(&str, &str, &str)]) -> ResourceSlice {
    let mut s = serde_json::to_value(slice(node, "NVIDIA A100-SXM4-80GB", n)).unwrap();
    for (i, d) in s["spec"]["devices"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .enumerate()
    {
        let numa = i64::try_from(i / (n / 2)).unwrap();
        d["attributes"]["resource.kubernetes.io/numaNode"] = json!({"int": numa});
        let name = d["name"].as_str().unwrap().to_string();
        let mine: Vec<Value> = taints
            .iter()
            .filter(|(dev, _, _)| *dev == name)
            .map(|(_, key, value)| json!({"key": key, "value": value, "effect": "NoSchedule"}))
            .collect();
        if !mine.is_empty() {
            d["taints"] = json!(mine);
        }
    }
    serde_json::from_value(s).unwrap()
}

/// Node `name` with capacity `cap` and allocatable `alloc` nvidia.com/gpu.
fn node_cap(name: &str, cap: u64, alloc: u64) -> Node {
    node(
        name,
        alloc,
        json!({"status": {"capacity": {"nvidia.com/gpu": cap.to_string()}}}),
    )
}

const XID: &str = "gpu.gpuplane.dev/unhealthy";

#[test]
fn unhealthy_gpus_the_pod_could_have_had_are_named_with_their_cause() {
    let listed = Listed {
        nodes: vec![node_cap("a", 4, 3), node_cap("b", 4, 4)],
        pods: vec![running("r", "b", 4)],
        slices: vec![
            numa_slice("a", 4, &[("gpu-3", XID, "xid-48")]),
            numa_slice("b", 4, &[]),
        ],
        classes: vec![gpu_class()],
        ..Default::default()
    };
    let (r, m) = answer_in(&pod("p", 4, json!({})), &listed);
    assert_eq!(r, Reason::Unhealthy);
    assert_eq!(
        m,
        "needs 4 nvidia.com/gpu; 3 free on nodes it may use; 1 more unhealthy: a gpu-3 (xid-48)"
    );
    // More than the unhealthy ones would give: plain Capacity.
    let (r, m) = answer_in(&pod("p", 5, json!({})), &listed);
    assert_eq!(
        (r, m.as_str()),
        (
            Reason::Capacity,
            "needs 5 nvidia.com/gpu; 3 free in the cluster"
        )
    );
}

#[test]
fn a_gpu_missing_from_allocatable_without_a_health_taint_is_not_called_unhealthy() {
    // Capacity 4, allocatable 3: the kubelet withdrew one (a claim holds it), no slice says
    // unhealthy. Nor is a health taint enough when the kubelet offers every device.
    for (alloc, taints) in [(3, vec![]), (4, vec![("gpu-3", XID, "xid-48")])] {
        let listed = Listed {
            nodes: vec![node_cap("a", 4, alloc)],
            slices: vec![numa_slice("a", 4, &taints)],
            classes: vec![gpu_class()],
            ..Default::default()
        };
        let (r, _) = answer_in(&pod("p", 5, json!({})), &listed);
        assert_eq!(
            r,
            Reason::Capacity,
            "allocatable {alloc}, taints {taints:?}"
        );
    }
}

#[test]
fn a_claim_short_of_untainted_devices_names_the_taints_unless_it_tolerates_them() {
    let drain = "example.com/maintenance";
    let mut l = listed(template(2, D, None), vec![]);
    l.slices = vec![
        numa_slice("a", 2, &[("gpu-1", XID, "xid-79")]),
        numa_slice(
            "b",
            2,
            &[
                ("gpu-0", drain, "drain"),
                ("gpu-1", "gpu.gpuplane.dev/device-plugin", "in-use"),
            ],
        ),
    ];
    let (r, m) = answer_in(&claim_pod(), &l);
    assert_eq!(r, Reason::Unhealthy);
    assert_eq!(
        m,
        format!("request gpu needs 2 device(s) of DeviceClass {D}; 1 of the 4 matching free and untainted; 2 more tainted: a/gpu-1 {XID}=xid-79:NoSchedule, b/gpu-0 {drain}=drain:NoSchedule")
    );
    // Three wanted: the tainted ones would not do, and a device the device plugin holds is
    // taken, not tainted: Capacity.
    l.templates = vec![template(4, D, None)];
    let (r, m) = answer_in(&claim_pod(), &l);
    assert_eq!(r, Reason::Capacity);
    assert_eq!(m, format!("request gpu needs 4 device(s) of DeviceClass {D}; 1 of the 4 matching free in the cluster"));
    // A request that tolerates the drain may have gpu-0 of b: two free, one per node.
    let mut t = serde_json::to_value(template(2, D, None)).unwrap();
    t["spec"]["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] =
        json!([{"key": drain, "operator": "Exists"}]);
    l.templates = vec![serde_json::from_value(t).unwrap()];
    assert_eq!(answer_in(&claim_pod(), &l).0, Reason::Fragmentation);
}

fn refused(gpus: u64) -> Pod {
    pod(
        "p",
        gpus,
        json!({
            "spec": {"nodeName": "a"},
            "status": {"phase": "Failed", "reason": "TopologyAffinityError", "message": "Pod was rejected: Resources cannot be allocated with Topology locality"},
        }),
    )
}

#[test]
fn a_pod_the_kubelet_refused_for_numa_alignment_is_topology_with_free_gpus_per_numa_node() {
    let listed = Listed {
        nodes: vec![node("a", 8, json!({}))],
        slices: vec![numa_slice("a", 8, &[("gpu-5", XID, "xid-48")])],
        classes: vec![gpu_class()],
        claims: vec![allocated("c1", &[("a", "gpu-0")])],
        ..Default::default()
    };
    assert!(refused_by_kubelet(&refused(5)));
    let (r, m) = answer_in(&refused(5), &listed);
    assert_eq!(r, Reason::Topology);
    assert_eq!(
        m,
        "the kubelet on a refused it (TopologyAffinityError): its topology manager could not put 5 nvidia.com/gpu on one NUMA node, which the scheduler does not see; free GPUs on a by NUMA node: 0: 3, 1: 3; ask for at most 3 there, or through a ResourceClaim with a matchAttribute constraint on resource.kubernetes.io/numaNode, which the scheduler does see"
    );
    // No NUMA layout published: it says so rather than guess.
    let mut bare = listed;
    bare.slices = vec![slice("a", "NVIDIA A100-SXM4-80GB", 8)];
    let (r, m) = answer_in(&refused(5), &bare);
    assert_eq!(r, Reason::Topology);
    assert!(
        m.ends_with("; a publishes no resource.kubernetes.io/numaNode for its GPUs"),
        "{m}"
    );
    // Failed for another reason: not waiting, not Topology.
    let mut other = refused(5);
    other.status.as_mut().unwrap().reason = Some("OutOfnvidia.com/gpu".into());
    assert!(!refused_by_kubelet(&other));
    assert_eq!(answer_in(&other, &bare).0, Reason::NotWaiting);
}
