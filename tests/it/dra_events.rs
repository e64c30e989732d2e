//! Events on ResourceClaims for the prepare failures a user must see, posted by the real agent
//! to the API server double (see tests/support/lab.rs for the set-up): the Event regards the
//! claim, says what to do, is posted once however often the kubelet retries, and a failed
//! Event write never fails or delays the prepare.

use crate::support;

use crate::lab::{Lab, DRIVER, NODE, WAIT};
use gpuplane_node::dra::ClaimRef;
use gpuplane_testkit::doubles::apiserver::Fault;
use serde_json::{json, Value};
use std::time::Duration;

fn events_about(lab: &Lab, claim: &ClaimRef) -> Vec<Value> {
    lab.api
        .list_json("events.k8s.io/v1", "events", Some(&claim.namespace))
        .into_iter()
        .filter(|e| e["regarding"]["uid"] == claim.uid.as_str())
        .collect()
}

/// `gpuplane_claim_events_total{outcome}` of the agent serving `/metrics` on `addr`.
async fn claim_events(addr: std::net::SocketAddr, outcome: &str) -> f64 {
    let sample = format!("gpuplane_claim_events_total{{outcome=\"{outcome}\"}}");
    tokio::task::spawn_blocking(move || {
        let (_, body) = support::http_get(addr, "/metrics").expect("/metrics answers");
        support::metric_value(&body, &sample).unwrap_or_else(|| panic!("no {sample} in {body}"))
    })
    .await
    .unwrap()
}

fn assert_regards(event: &Value, claim: &ClaimRef, reason: &str) {
    let r = &event["regarding"];
    assert_eq!(r["apiVersion"], "resource.k8s.io/v1", "{event}");
    assert_eq!(r["kind"], "ResourceClaim", "{event}");
    assert_eq!(r["namespace"], claim.namespace.as_str(), "{event}");
    assert_eq!(r["name"], claim.name.as_str(), "{event}");
    assert_eq!(event["reason"], reason, "{event}");
    assert_eq!(event["type"], "Warning", "{event}");
    assert_eq!(event["reportingController"], DRIVER, "{event}");
    assert_eq!(event["reportingInstance"], NODE, "{event}");
    assert!(event["eventTime"].is_string(), "{event}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_for_a_device_the_device_plugin_holds_gets_one_event_naming_the_holder() {
    let lab = Lab::new("a100-mig-mixed").await;
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], support::free_port()).into();
    let agent = lab.start_serving("flags: {migStrategy: mixed}\n", addr);
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.kubelet
        // Registered is not yet listed: admission needs the first ListAndWatch answer.
        .wait_for(WAIT, |p| {
            p.get("nvidia.com/gpu").is_some_and(|v| v.healthy() > 0)
        })
        .await
        .unwrap();
    // GPU 3 (MIG off) goes to a container through the device plugin API...
    lab.kubelet
        .admit("team-b", "pod-1", "main", "nvidia.com/gpu", 1)
        .await
        .unwrap();
    // ...which PodResources names before the claim is tried (a refusal naming the holder anew,
    // the container instead of the allocation, is news and gets an Event of its own)...
    let lists = lab.kubelet.pod_resources_lists();
    lab.eventually("PodResources listing the container", |l| {
        l.kubelet.pod_resources_lists() >= lists + 2
    })
    .await;
    // ...and a claim for it is refused; the kubelet retries.
    let claim = lab.claim("late", &["gpu-3"]);
    for _ in 0..3 {
        let err = lab.prepare(&claim).await.unwrap_err();
        assert!(err.contains("gpu-3"), "{err}");
    }
    lab.eventually("the Event on the claim", |l| {
        !events_about(l, &claim).is_empty()
    })
    .await;
    // One more retry after the first Event landed: still one Event. Whether to post is decided
    // before the prepare answers, and a suppressed Event is counted then.
    let deduplicated = claim_events(addr, "deduplicated").await;
    lab.prepare(&claim).await.unwrap_err();
    assert_eq!(
        claim_events(addr, "deduplicated").await,
        deduplicated + 1.0,
        "the retry's Event was not suppressed"
    );
    // Each of the four refusals' Events was suppressed, or posted or failed once its write was
    // answered: then every Event posted is stored.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let mut decided = 0.0;
        for outcome in ["posted", "deduplicated", "failed"] {
            decided += claim_events(addr, outcome).await;
        }
        if decided >= 4.0 {
            assert_eq!(decided, 4.0);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{decided} of 4 Events decided"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let events = events_about(&lab, &claim);
    assert_eq!(events.len(), 1, "{events:#?}");
    let e = &events[0];
    assert_regards(e, &claim, "DeviceInUse");
    assert_eq!(e["regarding"]["uid"], claim.uid.as_str());
    let note = e["note"].as_str().unwrap();
    // The holder: the container, as PodResources names it.
    assert!(
        note.contains("gpu-3") && note.contains("team-b/pod-1/main"),
        "{note}"
    );
    assert!(note.contains("delete this claim's pod"), "{note}");
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_opaque_config_is_told_on_the_claim_even_after_an_event_write_failed() {
    let lab = Lab::new("pcie-l4x4").await;
    let agent = lab.start("");
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    let stored = lab
        .api
        .put_json(json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "tuned", "namespace": "team-a"},
            "spec": {"devices": {"requests": [{"name": "gpus",
                "exactly": {"deviceClassName": "gpu.gpuplane.dev", "count": 1}}]}},
            "status": {"allocation": {"devices": {
                "results": [{"request": "gpus", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}],
                "config": [{"source": "FromClaim", "requests": ["gpus"], "opaque": {
                    "driver": DRIVER,
                    "parameters": {"apiVersion": "gpu.gpuplane.dev/v1alpha1", "kind": "GpuConfig",
                        "sharing": {"strategy": "Sliced"}}}}]}}}
        }))
        .unwrap();
    let claim = ClaimRef::parse(
        "team-a",
        stored["metadata"]["uid"].as_str().unwrap(),
        "tuned",
    )
    .unwrap();
    // The API server refuses Events for a while: the prepare answers as always.
    let fault = lab.api.inject(Fault::status("POST", "/events", 500));
    let err = lab.prepare(&claim).await.unwrap_err();
    assert!(
        err.contains("claim team-a/tuned") && err.contains("config"),
        "{err}"
    );
    lab.eventually("the refused Event write", |l| {
        l.api.count_requests("POST", "/events") > 0
    })
    .await;
    assert!(events_about(&lab, &claim).is_empty());
    // Once Events are accepted again, a later retry posts it (the failed write is forgotten
    // as soon as its answer arrives, which may be just after this point).
    lab.api.clear_fault(fault);
    let deadline = std::time::Instant::now() + WAIT;
    while events_about(&lab, &claim).is_empty() {
        assert!(std::time::Instant::now() < deadline, "no Event posted");
        lab.prepare(&claim).await.unwrap_err();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let events = events_about(&lab, &claim);
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_regards(&events[0], &claim, "InvalidDeviceConfig");
    let note = events[0]["note"].as_str().unwrap();
    assert!(note.contains("fix the opaque device config"), "{note}");
    agent.stop().await;
}

/// Shares that cannot be given: one of a GPU this node does not share, and one whose claim
/// also holds another device under MPS; each gets its Event with what to do, and one that fits
/// time-sliced (no MPS program here) is prepared with a `ShareLimitsNotEnforced` Event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn share_refusals_and_unenforced_shares_are_told_on_the_claim() {
    let lab = Lab::new("dgx-a100").await;
    let agent = lab.start("sharing:\n  consumableCapacity: {gpus: [0], enforcement: MPS}\n");
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    let cases = [
        (
            lab.share_claim("not-shared", "gpu-1", "8Gi", 20),
            "ShareNotOffered",
            "does not share it",
        ),
        (
            lab.share_claim("off-grid", "gpu-0", "1536Mi", 20),
            "ShareNotOffered",
            "multiples of 1Gi",
        ),
    ];
    for (claim, reason, why) in &cases {
        let err = lab.prepare(claim).await.unwrap_err();
        assert!(err.contains(why), "{err}");
        lab.eventually("the Event on the claim", |l| {
            !events_about(l, claim).is_empty()
        })
        .await;
        let events = events_about(&lab, claim);
        assert_regards(&events[0], claim, reason);
        assert!(
            events[0]["note"].as_str().unwrap().contains(why),
            "{events:#?}"
        );
    }
    let fits = lab.share_claim("fits", "gpu-0", "8Gi", 20);
    lab.prepare(&fits).await.unwrap();
    lab.eventually("the Event on the claim", |l| {
        !events_about(l, &fits).is_empty()
    })
    .await;
    let events = events_about(&lab, &fits);
    assert_regards(&events[0], &fits, "ShareLimitsNotEnforced");
    assert!(
        events[0]["note"]
            .as_str()
            .unwrap()
            .contains("gpu-0 (8Gi memory, 20% compute)"),
        "{events:#?}"
    );
    agent.stop().await;
}
