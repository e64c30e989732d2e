//! Gang, NoGPUCapacity from nodes whose agent is down, and the fragmentation ratio per pool.

use super::*;

fn gated(name: &str, gpus: u64, group: Option<(&str, &str)>, note: &str) -> Pod {
    let mut extra = json!({
        "spec": {"schedulingGates": [{"name": crate::quota::SCHEDULING_GATE}]},
        "status": {"conditions": [{"type": CONDITION, "status": "False", "message": note}]},
    });
    if let Some((g, size)) = group {
        extra["metadata"] = json!({
            "labels": {crate::controller::pods::GROUP_LABEL: g},
            "annotations": {crate::controller::pods::GROUP_SIZE_ANNOTATION: size},
        });
    }
    pod(name, gpus, extra)
}

#[test]
fn a_gated_group_member_is_gang_with_its_group_counts_and_what_the_queue_waits_for() {
    let nodes = [node("a", 4, json!({})), node("b", 4, json!({}))];
    let waiting = "pod group team-a/train (3 pods waiting): 3 of 4 members exist; released together once all do";
    let members: Vec<Pod> = (0..3)
        .map(|i| gated(&format!("m{i}"), 2, Some(("train", "4")), waiting))
        .collect();
    let (r, m) = answer(&members[0], &nodes, &members);
    assert_eq!(r, Reason::Gang);
    assert_eq!(
        m,
        "pod group team-a/train: 3 of 4 members exist, 3 held at the quota gate; none is released until the other 1 exist"
    );
    // All four there, held by the quota: the group's ask beside what is free, and the queue's
    // reason without its own lead.
    let note = "pod group team-a/train (4 pods waiting): waiting for quota: gpus: requested 8, used 2 of 8 in GpuQuota team-a/default";
    let mut members: Vec<Pod> = (0..4)
        .map(|i| gated(&format!("m{i}"), 2, Some(("train", "4")), note))
        .collect();
    members.push(running("r", "a", 2));
    let (r, m) = answer(&members[0], &nodes, &members);
    assert_eq!(r, Reason::Gang);
    assert_eq!(
        m,
        "pod group team-a/train, position 1 of 1 in namespace team-a's queue: 4 of 4 members exist, 4 held at the quota gate, asking together 8 nvidia.com/gpu (6 free in the cluster); released together once the quota admits all: waiting for quota: gpus: requested 8, used 2 of 8 in GpuQuota team-a/default"
    );
    // A bad size annotation is the group's problem, said as the queue says it.
    let bad = gated("x", 1, Some(("odd", "many")), "");
    let (r, m) = answer(&bad, &nodes, std::slice::from_ref(&bad));
    assert_eq!(r, Reason::Gang);
    assert_eq!(
        m,
        "pod group team-a/odd: annotation quota.gpuplane.dev/pod-group-size=\"many\" is not a positive number"
    );
    // A single pod stays Quota, with its place in the namespace's queue: behind the group,
    // which is older, and ahead of a younger pod; a higher priority goes first.
    let at = |name: &str, secs: u32, priority: i32| {
        let mut p = gated(
            name,
            1,
            None,
            "waiting for quota: gpus: requested 1, used 8 of 8",
        );
        let created = format!("2026-01-01T00:00:{secs:02}Z");
        p.metadata.creation_timestamp = Some(serde_json::from_value(json!(created)).unwrap());
        p.spec.as_mut().unwrap().priority = Some(priority);
        p
    };
    let (single, younger, urgent) = (at("s", 10, 0), at("t", 20, 0), at("u", 30, 5));
    let mut all = members.clone();
    for m in all.iter_mut() {
        let created = json!("2026-01-01T00:00:00Z");
        m.metadata.creation_timestamp = Some(serde_json::from_value(created).unwrap());
    }
    all.extend([single.clone(), younger, urgent.clone()]);
    let (r, m) = answer(&single, &nodes, &all);
    assert_eq!(r, Reason::Quota);
    assert_eq!(
        m,
        "held by GPU quota, position 3 of 4 in namespace team-a's queue: waiting for quota: gpus: requested 1, used 8 of 8"
    );
    assert!(answer(&urgent, &nodes, &all).1.contains("position 1 of 4"));
}

/// A node whose device plugin left: the kubelet keeps the resource at 0.
fn unplugged(name: &str, capacity: u64) -> Node {
    node(
        name,
        0,
        json!({
            "metadata": {"labels": {"nvidia.com/gpu.count": "4", "nvidia.com/gpu.product": "NVIDIA-H100"}},
            "status": {"capacity": {"nvidia.com/gpu": capacity.to_string()}},
        }),
    )
}

/// A Ready node listing no GPU resource at all.
fn bare(name: &str, labels: Value) -> Node {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "status": {"allocatable": {"cpu": "8"}, "conditions": [{"type": "Ready", "status": "True"}]},
    }))
    .unwrap()
}

#[test]
fn gpu_nodes_whose_agent_is_down_are_named_as_no_gpu_capacity() {
    let labelled_only = bare("c", json!({"nvidia.com/gpu.present": "true"}));
    let nodes = [unplugged("b", 0), labelled_only.clone()];
    let (r, m) = answer(&pod("p", 1, json!({})), &nodes, &[]);
    assert_eq!(r, Reason::NoGpuCapacity);
    assert_eq!(
        m,
        "needs 1 nvidia.com/gpu; no node offers nvidia.com/gpu: b: nvidia.com/gpu capacity 0 (agent not registered); c: labelled nvidia.com/gpu.present=true, offers no GPU resource (agent not registered)"
    );
    // One node up with too few free, one down that had enough: restore the agent first.
    let nodes = [node("a", 4, json!({})), unplugged("b", 4)];
    let (r, m) = answer(&pod("p", 6, json!({})), &nodes, &[]);
    assert_eq!(r, Reason::NoGpuCapacity);
    assert_eq!(
        m,
        "needs 6 nvidia.com/gpu; 4 free in the cluster; GPU nodes offering none: b: nvidia.com/gpu allocatable 0 of capacity 4 (device plugin disconnected, or every device unhealthy)"
    );
    // What the down node had cannot make 12 either: that is capacity. Nor 6, when its own
    // pods hold 3 of its 4.
    let (r, _) = answer(&pod("p", 12, json!({})), &nodes, &[]);
    assert_eq!(r, Reason::Capacity);
    let (r, _) = answer(&pod("p", 6, json!({})), &nodes, &[running("h", "b", 3)]);
    assert_eq!(r, Reason::Capacity);
    // It fits on what is up: not our business who is down.
    let (r, _) = answer(&pod("p", 2, json!({})), &nodes, &[]);
    assert_eq!(r, Reason::Unknown);
    // A plain CPU node (no GPU resource ever listed, no GPU label) is no GPU node.
    let (r, m) = answer(&pod("p", 1, json!({})), &[bare("cpu", json!({}))], &[]);
    assert_eq!(r, Reason::NoGpuCapacity);
    assert!(
        m.ends_with("(is the gpuplane agent running and registered on the GPU nodes?)"),
        "{m}"
    );
}

#[test]
fn gpu_nodes_without_resource_slices_are_named_for_a_claim() {
    let gpu_node = |name: &str| {
        node(
            name,
            0,
            json!({"metadata": {"labels": {"nvidia.com/gpu.count": "2"}}}),
        )
    };
    // Every slice gone: no device of the class at all.
    let mut l = listed(template(1, D, None), vec![]);
    l.slices.clear();
    l.nodes = vec![gpu_node("b"), gpu_node("a")];
    let (r, m) = answer_in(&claim_pod(), &l);
    assert_eq!(r, Reason::NoGpuCapacity);
    let why = "no ResourceSlice (DRA driver not registered: agent stopped or driver down)";
    assert_eq!(
        m,
        format!("request gpu: no device of DeviceClass {D} is published; GPU nodes offering none: a: {why}; b: {why}")
    );
    // Node b's slice gone, a's there with 2: a request of 3 waits for b.
    let mut l = listed(template(3, D, None), vec![]);
    l.slices.truncate(1);
    l.nodes = vec![gpu_node("a"), gpu_node("b")];
    let (r, m) = answer_in(&claim_pod(), &l);
    assert_eq!(r, Reason::NoGpuCapacity);
    assert_eq!(
        m,
        format!("request gpu needs 3 device(s) of DeviceClass {D}; 2 of the 2 matching free in the cluster; GPU nodes offering none: b: {why}")
    );
}

#[test]
fn the_fragmentation_ratio_per_pool_is_one_less_the_largest_free_share() {
    let h100 = |name: &str, gpus: u64| {
        node(
            name,
            gpus,
            json!({"metadata": {"labels": {POOL_LABEL: "NVIDIA-H100"}}}),
        )
    };
    let cordoned = node(
        "z",
        8,
        json!({"metadata": {"labels": {POOL_LABEL: "NVIDIA-H100"}}, "spec": {"unschedulable": true}}),
    );
    let nodes = [
        h100("a", 4),
        h100("b", 4),
        h100("c", 4),
        node("l", 2, json!({})),
        cordoned,
    ];
    let pods = [
        running("x", "a", 2),
        running("y", "b", 3),
        running("z", "c", 4),
    ];
    let cluster = Cluster::new(
        &Listed {
            nodes: nodes.to_vec(),
            pods: pods.to_vec(),
            ..Default::default()
        },
        CatalogSettings::default(),
    );
    let pools = fragmentation_by_pool(&cluster.nodes);
    let want = |pool: &str, free, largest, ratio| PoolFragmentation {
        pool: pool.into(),
        resource: "nvidia.com/gpu".into(),
        free,
        largest,
        ratio,
    };
    // H100: 2 + 1 + 0 free, at most 2 on one: 1 - 2/3. The unlabelled node: all on one.
    assert_eq!(
        pools,
        vec![
            want("NVIDIA-H100", 3, 2, 1.0 - 2.0 / 3.0),
            want("unlabelled", 2, 2, 0.0)
        ]
    );
    // Nothing free: 0, not a division by zero.
    let full = [running("f", "l", 2)];
    let cluster = Cluster::new(
        &Listed {
            nodes: vec![node("l", 2, json!({}))],
            pods: full.to_vec(),
            ..Default::default()
        },
        CatalogSettings::default(),
    );
    assert_eq!(
        fragmentation_by_pool(&cluster.nodes),
        vec![want("unlabelled", 0, 0, 0.0)]
    );
}
