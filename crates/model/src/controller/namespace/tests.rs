use super::*;
use crate::quota::{CatalogSettings, Gpus};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use serde_json::{json, Value};

const NS: &str = "team-a";

fn pod(name: &str, gpus: u32, gated: bool, extra: Value) -> Arc<Pod> {
    let mut v = json!({
        "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}"),
                     "creationTimestamp": "2025-01-01T00:00:00Z"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]}
    });
    if gated {
        v["spec"]["schedulingGates"] = json!([{"name": crate::quota::SCHEDULING_GATE}]);
    } else {
        v["spec"]["nodeName"] = json!("node-1");
    }
    merge(&mut v, extra);
    Arc::new(serde_json::from_value(v).unwrap())
}

/// Merges `extra` into `v`, objects recursively.
fn merge(v: &mut Value, extra: Value) {
    match (v, extra) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, x) in b {
                merge(a.entry(k).or_insert(Value::Null), x);
            }
        }
        (slot, x) => *slot = x,
    }
}

fn quota(name: &str, gpus: u64, status: Value) -> GpuQuota {
    serde_json::from_value(json!({
        "apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": name, "namespace": NS, "resourceVersion": "7"},
        "spec": {"hard": {"gpus": gpus.to_string()}, "mode": "Queue"},
        "status": status
    }))
    .unwrap()
}

fn reserved(name: &str, kind: &str, gpus: u64) -> Value {
    json!({"kind": kind, "namespace": NS, "name": name, "state": "Reserved",
           "charge": {"gpus": gpus.to_string()}, "since": "2025-01-01T00:00:00Z"})
}

/// A cycle's input for team-a at a fixed instant.
fn inputs<'a>(
    pods: &'a [Arc<Pod>],
    claims: &'a [Arc<ResourceClaim>],
    templates: &'a BTreeMap<String, ResourceClaimSpec>,
    catalog: &'a DeviceCatalog,
    candidates: &'a [crate::controller::preempt::Candidate],
) -> Inputs<'a> {
    Inputs {
        namespace: NS,
        pods,
        claims,
        templates,
        catalog,
        now: SystemTime::UNIX_EPOCH + Duration::from_secs(1_735_689_700),
        settings: QueueSettings::default(),
        hours: None,
        candidates,
    }
}

fn run(
    pods: &[Arc<Pod>],
    claims: &[Arc<ResourceClaim>],
    catalog: &DeviceCatalog,
    quotas: &[GpuQuota],
) -> Decision {
    run_with_templates(pods, claims, &BTreeMap::new(), catalog, quotas)
}

fn run_with_templates(
    pods: &[Arc<Pod>],
    claims: &[Arc<ResourceClaim>],
    templates: &BTreeMap<String, ResourceClaimSpec>,
    catalog: &DeviceCatalog,
    quotas: &[GpuQuota],
) -> Decision {
    let input = inputs(pods, claims, templates, catalog, &[]);
    let mut working = Working::default();
    let observed = observe(&input, &mut Charges::default()).unwrap();
    decide(&input, &observed, quotas, &mut working).unwrap()
}

fn names(refs: &[PodRef]) -> Vec<&str> {
    refs.iter().map(|r| r.name.as_str()).collect()
}

#[test]
fn a_gated_pod_already_reserved_in_every_quota_is_ungated_without_planning_again() {
    let pods = [pod("p", 4, true, json!({}))];
    let q = quota(
        "default",
        2,
        json!({"reservations": [reserved("p", "Pod", 4)]}),
    );
    let d = run(&pods, &[], &DeviceCatalog::default(), &[q]);
    assert_eq!(names(&d.admitted_gated), ["p"]);
    assert!(d.releases.is_empty() && d.waiting.is_empty());
}

#[test]
fn a_release_is_recorded_as_reserved_in_every_quota_of_the_namespace() {
    let pods = [
        pod("run", 1, false, json!({})),
        pod("p", 2, true, json!({})),
    ];
    let quotas = [quota("default", 8, json!({})), quota("extra", 4, json!({}))];
    let d = run(&pods, &[], &DeviceCatalog::default(), &quotas);
    assert_eq!(d.releases.len(), 1);
    assert_eq!(names(&d.releases[0]), ["p"]);
    for (q, changed) in &d.quotas {
        assert!(changed);
        let s = q.status.as_ref().unwrap();
        assert_eq!(s.used.gpus, Gpus::whole(1));
        assert_eq!(s.reserved.gpus, Gpus::whole(2));
        let r = s.reservation(&ReservationKey::pod(NS, "p")).unwrap();
        assert_eq!(
            (r.state, r.uid.as_deref()),
            (ReservationState::Reserved, Some("uid-p"))
        );
        assert_eq!(
            q.metadata.resource_version.as_deref(),
            Some("7"),
            "written against what was read"
        );
    }
    // The second quota is the tighter one: a pod needing 4 more waits, and says which quota.
    let pods = [
        pod("run", 1, false, json!({})),
        pod("big", 4, true, json!({})),
    ];
    let d = run(&pods, &[], &DeviceCatalog::default(), &quotas);
    assert!(d.releases.is_empty());
    assert_eq!(
        d.waiting[0].1.message,
        "waiting for quota: gpus: requested 4, used 1 of 4 in GpuQuota team-a/extra"
    );
}

#[test]
fn pods_that_cannot_be_priced_or_grouped_wait_with_their_reason_and_block_nobody() {
    let pods = [
        pod(
            "templated",
            0,
            true,
            json!({"spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "missing"}]}}),
        ),
        pod(
            "m",
            1,
            true,
            json!({"metadata": {"labels": {"quota.gpuplane.dev/pod-group": "g"},
                                              "annotations": {"quota.gpuplane.dev/pod-group-size": "many"}}}),
        ),
        pod("ok", 1, true, json!({})),
    ];
    let d = run(
        &pods,
        &[],
        &DeviceCatalog::default(),
        &[quota("default", 8, json!({}))],
    );
    assert_eq!(
        d.releases.iter().map(|u| names(u)).collect::<Vec<_>>(),
        [["ok"]]
    );
    let note = |n: &str| {
        d.waiting
            .iter()
            .find(|(p, _)| p.name == n)
            .map(|(_, n)| n.clone())
            .unwrap()
    };
    assert_eq!(note("templated").kind, "WaitingForTemplate");
    assert!(
        note("templated")
            .message
            .contains("waiting for ResourceClaimTemplate team-a/missing to be created"),
        "{:?}",
        note("templated")
    );
    assert_eq!(note("m").kind, "BadGroup");
    assert!(note("m")
        .message
        .contains("\"many\" is not a positive number"));
}

fn catalog() -> DeviceCatalog {
    let devices: Vec<Value> = (0..2)
        .map(|i| {
            json!({"name": format!("gpu-{i}"),
                   "attributes": {"type": {"string": "gpu"}, "productName": {"string": "NVIDIA H100"}},
                   "capacity": {"memory": {"value": "80Gi"}}})
        })
        .collect();
    let slice: ResourceSlice = serde_json::from_value(json!({
        "metadata": {"name": "node-1-gpus"},
        "spec": {"driver": "gpu.gpuplane.dev", "nodeName": "node-1",
                 "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1},
                 "devices": devices}
    }))
    .unwrap();
    let class: DeviceClass = serde_json::from_value(json!({
        "metadata": {"name": "gpu.gpuplane.dev"},
        "spec": {"selectors": [{"cel": {"expression": "device.driver == \"gpu.gpuplane.dev\""}}]}
    }))
    .unwrap();
    DeviceCatalog::new(&[slice], &[class], CatalogSettings::default())
}

#[test]
fn an_allocated_standalone_claim_settles_into_used_and_its_reservation_goes() {
    let claim = |name: &str, allocated: bool| -> Arc<ResourceClaim> {
        let mut v = json!({
            "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}")},
            "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu.gpuplane.dev", "count": 2}}]}}
        });
        if allocated {
            v["status"] = json!({"allocation": {"devices": {"results": [
                {"request": "r", "driver": "gpu.gpuplane.dev", "pool": "node-1", "device": "gpu-0"}]}}});
        }
        Arc::new(serde_json::from_value(v).unwrap())
    };
    let claims = [claim("done", true), claim("pending", false)];
    let q = quota(
        "default",
        8,
        json!({"reservations": [reserved("done", "ResourceClaim", 2), reserved("pending", "ResourceClaim", 2)]}),
    );
    let d = run(&[], &claims, &catalog(), &[q]);
    let s = d.quotas[0].0.status.clone().unwrap();
    // Worst case 2 GPUs at admission; allocated one device: settles to 1.
    assert_eq!(s.used.gpus, Gpus::whole(1));
    assert!(s.reservation(&ReservationKey::claim(NS, "done")).is_none());
    assert!(s
        .reservation(&ReservationKey::claim(NS, "pending"))
        .is_some());
    assert_eq!(s.reserved.gpus, Gpus::whole(2));
}

#[test]
fn a_remembered_charge_is_used_only_for_the_resource_version_it_was_priced_at() {
    let templates = BTreeMap::new();
    let catalog = DeviceCatalog::default();
    let used_with = |pods: &[Arc<Pod>], charges: &mut Charges| {
        let input = inputs(pods, &[], &templates, &catalog, &[]);
        observe(&input, charges).unwrap().used.gpus
    };
    let mut charges = Charges::default();
    let v1 = |gpus| {
        pod(
            "p",
            gpus,
            false,
            json!({"metadata": {"resourceVersion": "1"}}),
        )
    };
    assert_eq!(used_with(&[v1(2)], &mut charges), Gpus::whole(2));
    // Same pod, same resourceVersion: the remembered charge (even though this copy differs).
    assert_eq!(used_with(&[v1(3)], &mut charges), Gpus::whole(2));
    // A new resourceVersion is priced again.
    let v2 = pod("p", 3, false, json!({"metadata": {"resourceVersion": "2"}}));
    assert_eq!(used_with(&[v2], &mut charges), Gpus::whole(3));
    // Cleared (templates or catalog changed): priced again.
    charges.clear();
    assert_eq!(used_with(&[v1(4)], &mut charges), Gpus::whole(4));
}

/// A gated pod whose template is not created yet waits, charged nothing; once the template
/// exists it is priced from it and released when it fits, or kept with the quota's reason.
#[test]
fn a_pod_waiting_for_its_template_is_priced_from_it_once_it_exists() {
    let templated = |name: &str| {
        pod(
            name,
            0,
            true,
            json!({"spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]}}),
        )
    };
    let pods = [templated("w")];
    let q = || quota("default", 1, json!({}));
    let d = run(&pods, &[], &catalog(), &[q()]);
    assert!(d.releases.is_empty());
    assert_eq!(d.waiting.len(), 1);
    assert_eq!(d.waiting[0].1.kind, "WaitingForTemplate");
    let status = d.quotas[0].0.status.clone().unwrap_or_default();
    assert!(status.reservations.is_empty() && status.reserved.is_zero() && status.used.is_zero());

    let spec = |count: u32| -> ResourceClaimSpec {
        serde_json::from_value(json!({"devices": {"requests": [{"name": "g", "exactly":
            {"deviceClassName": "gpu.gpuplane.dev", "allocationMode": "ExactCount", "count": count}}]}}))
        .unwrap()
    };
    // One GPU fits the quota of one: released and reserved at the template's price.
    let templates = BTreeMap::from([("t".to_string(), spec(1))]);
    let d = run_with_templates(&pods, &[], &templates, &catalog(), &[q()]);
    assert_eq!(
        d.releases.iter().map(|u| names(u)).collect::<Vec<_>>(),
        [["w"]]
    );
    let status = d.quotas[0].0.status.clone().unwrap();
    assert_eq!(status.reservations[0].state, ReservationState::Reserved);
    assert_eq!(status.reserved.gpus, Gpus::new(1, 1).unwrap());
    // Two GPUs never fit a quota of one: kept gated, with the quota's reason.
    let templates = BTreeMap::from([("t".to_string(), spec(2))]);
    let d = run_with_templates(&pods, &[], &templates, &catalog(), &[q()]);
    assert!(d.releases.is_empty());
    assert_eq!(d.waiting[0].1.kind, "ExceedsQuota");
    assert!(
        d.waiting[0].1.message.contains("GpuQuota team-a/default"),
        "{:?}",
        d.waiting[0].1
    );
}

#[test]
fn no_more_pods_are_released_than_the_reservation_list_can_record() {
    // Admitted elsewhere, not seen yet (within their grace): all but two entries taken.
    let mut entries: Vec<Value> = (0..MAX_RESERVATIONS - 2)
        .map(|i| reserved(&format!("unseen-{i}"), "Pod", 1))
        .collect();
    let pods: Vec<Arc<Pod>> = (0..5)
        .map(|i| pod(&format!("g{i}"), 1, true, json!({})))
        .collect();
    entries.push(
        json!({"kind": "Pod", "namespace": NS, "name": "g4", "state": "Queued",
                        "charge": {"gpus": "1"}, "since": "2025-01-01T00:00:00Z"}),
    );
    let q = quota("default", 100_000, json!({"reservations": entries}));
    let d = run(&pods, &[], &DeviceCatalog::default(), &[q]);
    let released: usize = d.releases.iter().map(Vec::len).sum();
    assert_eq!(released, 2, "{:?}", d.releases);
    let s = d.quotas[0].0.status.as_ref().unwrap();
    assert!(s.reservations.len() <= MAX_RESERVATIONS);
    // The rest waits for the next cycle; a queued entry gave way to a reserved one.
    assert_eq!(s.room(), 0);
}

#[test]
fn a_raise_admits_while_it_lasts_wakes_the_loop_at_its_expiry_and_is_told_when_it_ends() {
    // The tests' clock reads 2025-01-01T00:01:40Z.
    let raised = |expires: &str| {
        let mut q = quota("default", 2, json!({}));
        q.spec.temporary = serde_json::from_value(json!([
            {"hard": {"gpus": "2"}, "expires": expires, "reason": "launch"}]))
        .unwrap();
        q
    };
    let pods = [
        pod("run", 2, false, json!({})),
        pod("p", 2, true, json!({})),
    ];
    let d = run(
        &pods,
        &[],
        &DeviceCatalog::default(),
        &[raised("2025-01-01T00:05:00Z")],
    );
    assert_eq!(d.releases.len(), 1, "{:?}", d.waiting);
    assert_eq!(
        d.next_deadline,
        Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_735_689_900)),
        "woken when the raise ends"
    );
    let (q, changed) = &d.quotas[0];
    assert!(*changed && d.quota_events.is_empty());
    let s = q.status.as_ref().unwrap();
    assert_eq!(s.temporary[0].state, crate::quota::RaiseState::InForce);
    assert_eq!(
        q.spec.temporary.len(),
        1,
        "the spec is written back as read"
    );

    // Expired (and in force when last written): the pod waits on the base, one Event.
    let mut was = raised("2025-01-01T00:01:00Z");
    was.status = Some(
        serde_json::from_value(json!({"temporary": [
            {"reason": "launch", "expires": "2025-01-01T00:01:00Z", "state": "InForce"}]}))
        .unwrap(),
    );
    let pods = [
        pod("run", 2, false, json!({})),
        pod("p", 2, true, json!({})),
    ];
    let d = run(&pods, &[], &DeviceCatalog::default(), &[was]);
    assert!(d.releases.is_empty());
    assert!(
        d.waiting[0]
            .1
            .message
            .contains("of 2 in GpuQuota team-a/default"),
        "{:?}",
        d.waiting
    );
    assert_eq!(d.quota_events.len(), 1);
    let (name, reason, message) = &d.quota_events[0];
    assert_eq!(
        (name.as_str(), *reason),
        ("default", "TemporaryRaiseExpired")
    );
    assert!(
        message.starts_with("temporary raise gpus +2 (launch) expired at 2025-01-01T00:01:00Z"),
        "{message}"
    );
}

mod preemption {
    use super::*;
    use crate::controller::preempt::Candidate;

    fn decide_with(pods: &[Arc<Pod>], quotas: &[GpuQuota]) -> Decision {
        let catalog = DeviceCatalog::default();
        let templates = BTreeMap::new();
        let candidates: Vec<Candidate> = pods
            .iter()
            .filter(|p| pods::is_counted(p))
            .map(|p| Candidate::of(p, pod_charge(p, &templates, &catalog).unwrap()))
            .collect();
        let input = inputs(pods, &[], &templates, &catalog, &candidates);
        let mut working = Working::default();
        let observed = observe(&input, &mut Charges::default()).unwrap();
        decide(&input, &observed, quotas, &mut working).unwrap()
    }

    fn preempting_quota(gpus: u64) -> GpuQuota {
        let mut q = quota("default", gpus, json!({}));
        q.spec.preemption.within_quota = crate::quota::WithinQuota::LowerPriority;
        q
    }

    fn running(name: &str, gpus: u32, priority: i32, started: &str) -> Arc<Pod> {
        pod(
            name,
            gpus,
            false,
            json!({"spec": {"priority": priority}, "status": {"phase": "Running", "startTime": started}}),
        )
    }

    #[test]
    fn a_waiting_pod_of_higher_priority_evicts_the_newest_lower_one_and_is_told_so() {
        let mut pods = vec![
            running("train-old", 1, 0, "2025-01-01T00:00:00Z"),
            running("train-new", 1, 0, "2025-01-01T00:05:00Z"),
            pod("infer", 1, true, json!({"spec": {"priority": 1000}})),
        ];
        let d = decide_with(&pods, &[preempting_quota(2)]);
        assert!(d.releases.is_empty(), "never admitted over hard");
        let victims: Vec<&str> = d.evictions.iter().map(|e| e.victim.name.as_str()).collect();
        assert_eq!(victims, ["train-new"]);
        let e = &d.evictions[0];
        assert_eq!(e.preemptor, "pod team-a/infer");
        assert_eq!(names(&e.preemptor_pods), ["infer"]);
        assert!(
            e.message
                .contains("priority 0 is below the preemptor's 1000"),
            "{}",
            e.message
        );
        let (p, n) = &d.waiting[0];
        assert_eq!((p.name.as_str(), n.kind), ("infer", PREEMPTING));
        assert!(n.message.contains("preempting 1 pod(s)"), "{}", n.message);
        assert!(
            n.message.contains("team-a/train-new (priority 0)"),
            "{}",
            n.message
        );

        // Next cycle the victim terminates: no one more is evicted; the pod waits for it.
        pods[1] = running("train-new", 1, 0, "2025-01-01T00:05:00Z");
        Arc::make_mut(&mut pods[1]).metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::UNIX_EPOCH),
        );
        let d = decide_with(&pods, &[preempting_quota(2)]);
        assert!(d.evictions.is_empty() && d.releases.is_empty());
        assert_eq!(d.waiting[0].1.kind, PREEMPTING);
        assert!(
            d.waiting[0].1.message.contains("free enough once gone"),
            "{}",
            d.waiting[0].1.message
        );

        // Once it is gone the planner releases the waiting pod.
        pods.remove(1);
        let d = decide_with(&pods, &[preempting_quota(2)]);
        assert_eq!(d.releases.len(), 1);
        assert!(d.evictions.is_empty());
    }

    #[test]
    fn two_waiting_pods_never_count_on_the_same_victim() {
        let pods = [
            running("a", 1, 0, "2025-01-01T00:00:00Z"),
            running("b", 1, 0, "2025-01-01T00:01:00Z"),
            pod("x", 1, true, json!({"spec": {"priority": 100}})),
            pod("y", 1, true, json!({"spec": {"priority": 50}})),
        ];
        let d = decide_with(&pods, &[preempting_quota(2)]);
        let mut victims: Vec<&str> = d.evictions.iter().map(|e| e.victim.name.as_str()).collect();
        victims.sort();
        assert_eq!(victims, ["a", "b"]);
        assert_eq!(d.evictions[0].preemptor, "pod team-a/x");
        assert_eq!(d.evictions[1].preemptor, "pod team-a/y");
    }

    #[test]
    fn without_a_policy_or_with_no_lower_priority_pod_no_one_is_evicted_and_the_note_says_why() {
        let pods = [
            running("a", 1, 100, "2025-01-01T00:00:00Z"),
            pod("x", 1, true, json!({"spec": {"priority": 100}})),
        ];
        let d = decide_with(&pods, &[quota("default", 1, json!({}))]);
        assert!(d.evictions.is_empty());
        assert_eq!(d.waiting[0].1.kind, "Insufficient");
        assert!(!d.waiting[0].1.message.contains("preemption"));
        let d = decide_with(&pods, &[preempting_quota(1)]);
        assert!(d.evictions.is_empty());
        assert_eq!(d.waiting[0].1.kind, "Insufficient");
        assert!(
            d.waiting[0]
                .1
                .message
                .contains("no preemption: no running pod may be evicted"),
            "{}",
            d.waiting[0].1.message
        );
    }

    #[test]
    fn a_smaller_pod_behind_never_takes_the_room_a_preemptor_frees() {
        // x (priority 100, 2 GPUs) had r2 and r3 evicted; r3 is gone, r2 terminates: 1 of 3
        // is free. y (priority 0, 1 GPU) would fit in it, but that is x's room: y waits and
        // no one more is evicted (without the hold, the pass would evict r1 too).
        let mut r2 = running("r2", 1, 0, "2025-01-01T00:01:00Z");
        Arc::make_mut(&mut r2).metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::UNIX_EPOCH),
        );
        let pods = [
            running("r1", 1, 0, "2025-01-01T00:00:00Z"),
            r2,
            pod("x", 2, true, json!({"spec": {"priority": 100}})),
            pod(
                "y",
                1,
                true,
                json!({"spec": {"priority": 0}, "metadata": {"creationTimestamp": "2025-01-01T00:02:00Z"}}),
            ),
        ];
        let d = decide_with(&pods, &[preempting_quota(3)]);
        assert!(d.releases.is_empty(), "{:?}", d.releases);
        assert!(d.evictions.is_empty(), "{:?}", d.evictions);
        let note = |name: &str| {
            d.waiting
                .iter()
                .find(|(p, _)| p.name == name)
                .map(|(_, n)| n.clone())
                .unwrap()
        };
        assert_eq!(note("x").kind, PREEMPTING);
        assert!(
            note("x")
                .message
                .contains("free enough once gone: team-a/r2"),
            "{:?}",
            note("x")
        );
        assert_eq!(note("y").kind, "Insufficient");
        assert!(
            note("y")
                .message
                .contains("room held for pod team-a/x, which preempts pods for it"),
            "{:?}",
            note("y")
        );
    }
}
