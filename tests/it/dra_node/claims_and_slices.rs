//! Claims prepared and unprepared through DRA with their CDI specs and device status, and the
//! ResourceSlices published (valid, not rewritten on restart, not before PodResources answers).

use super::*;

/// A prepared claim's `status.devices` carries our entry (identity in `data`, `Ready`), and
/// unprepare removes it; a status write that fails never fails the prepare.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_claims_get_device_status_and_a_failed_status_write_does_not_fail_them() {
    let lab = Lab::new("a100-mig-mixed").await;
    let agent = lab.start("");
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.eventually("slices published", |l| !l.slices().is_empty())
        .await;
    let stored = |name: &str| {
        lab.api
            .get_json("resource.k8s.io/v1", "resourceclaims", Some("team-a"), name)
            .unwrap()
    };
    let mig = lab
        .slices()
        .iter()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .find(|d| d["name"].as_str().is_some_and(|n| n.contains("-mig-")))
        .unwrap();
    let mig_name = mig["name"].as_str().unwrap().to_string();
    let c = lab.claim("with-status", &[&mig_name]);
    lab.prepare(&c).await.unwrap();
    lab.eventually("our status.devices entry", |_| {
        stored("with-status")["status"]["devices"]
            .as_array()
            .is_some_and(|d| !d.is_empty())
    })
    .await;
    let entry = stored("with-status")["status"]["devices"][0].clone();
    assert_eq!(entry["driver"], DRIVER);
    assert_eq!(entry["pool"], NODE);
    assert_eq!(entry["device"], mig_name.as_str());
    assert!(
        entry["data"]["parentUUID"]
            .as_str()
            .is_some_and(|u| u.starts_with("GPU-")),
        "{entry}"
    );
    assert!(entry["data"]["profile"].is_string(), "{entry}");
    assert_eq!(entry["conditions"][0]["type"], "Ready");
    lab.unprepare(&c).await;
    lab.eventually("our entry removed on unprepare", |_| {
        stored("with-status")["status"]["devices"]
            .as_array()
            .is_none_or(|d| d.is_empty())
    })
    .await;

    let fault = lab.api.inject(Fault::status("PATCH", "/status", 500));
    let c = lab.claim("status-fails", &[&mig_name]);
    lab.prepare(&c).await.unwrap();
    lab.api.clear_fault(fault);
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_are_published_valid_and_a_restart_with_the_same_inventory_writes_nothing() {
    let lab = Lab::new("h100-mig-single").await;
    let agent = lab.start("flags: {migStrategy: single}\n");
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.eventually("56 published MIG devices", |l| {
        l.slices()
            .iter()
            .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
            .sum::<usize>()
            == 56
    })
    .await;
    for s in lab.slices() {
        let slice: k8s_openapi::api::resource::v1::ResourceSlice =
            serde_json::from_value(s).unwrap();
        gpuplane_node::slices::validate::validate(&slice).unwrap();
        assert_eq!(slice.spec.node_name.as_deref(), Some(NODE));
    }
    assert!(Lab::device(&lab.slices(), "gpu-0-mig-1g10gb-1").is_some());
    assert!(lab.api.count_writes() > 0);
    agent.stop().await;
    lab.api.clear_requests();
    let addr = metrics_addr();
    let agent = lab.start_serving("flags: {migStrategy: single}\n", addr);
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    // Ready: the restarted agent's publisher has synced (compared, and written what differed).
    wait_ready(addr).await;
    assert_eq!(
        lab.api.count_writes(),
        0,
        "restart wrote: {:?}",
        lab.api.requests()
    );
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_is_prepared_once_with_its_own_cdi_spec_and_unprepared_without_a_trace() {
    let lab = Lab::new("dgx-h100").await;
    let agent = lab.start("");
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    let good = lab.claim("train", &["gpu-0", "gpu-1"]);
    let foreign = {
        let obj = json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "elsewhere", "namespace": "team-a"},
            "status": {"allocation": {"devices": {"results": [{"request": "gpus", "driver": DRIVER, "pool": "node-b", "device": "gpu-0"}]}}}});
        let stored = lab.api.put_json(obj).unwrap();
        ClaimRef::parse(
            "team-a",
            stored["metadata"]["uid"].as_str().unwrap(),
            "elsewhere",
        )
        .unwrap()
    };
    let answers = lab
        .dra
        .prepare(DRIVER, &[good.clone(), foreign.clone()])
        .await
        .unwrap();
    let ids: Vec<String> = answers[good.uid.as_str()]
        .as_ref()
        .unwrap()
        .iter()
        .flat_map(|d| d.cdi_ids.clone())
        .collect();
    assert_eq!(ids.len(), 2);
    assert!(ids[0].starts_with("k8s.gpu.gpuplane.dev/claim="), "{ids:?}");
    let err = answers[foreign.uid.as_str()].as_ref().unwrap_err();
    assert!(
        err.contains("node-b") && err.contains("team-a/elsewhere"),
        "{err}"
    );
    let spec = lab
        .dir
        .path()
        .join(format!("cdi/gpuplane-claim-{}.json", good.uid));
    let before = std::fs::metadata(&spec).unwrap().modified().unwrap();
    assert_eq!(
        lab.prepare(&good).await.unwrap(),
        ids,
        "a repeated prepare answers the same"
    );
    assert_eq!(
        std::fs::metadata(&spec).unwrap().modified().unwrap(),
        before,
        "and rewrites nothing"
    );
    lab.unprepare(&good).await;
    assert!(!spec.exists());
    lab.unprepare(&good).await; // unknown claims succeed
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_waits_until_the_slices_are_published_and_metrics_count_the_writes() {
    use gpuplane_testkit::doubles::apiserver::Fault;
    let lab = Lab::new("dgx-h100").await;
    let refused = lab.api.inject(Fault::status("POST", "resourceslices", 500));
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], support::free_port()).into();
    let agent = lab.start_agent_serving("", Some(addr)).unwrap();
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    // Registered with the kubelet, but the API server refuses every slice: not ready, and why.
    let mut last = (0, String::new());
    for _ in 0..100 {
        last = tokio::task::spawn_blocking(move || {
            support::http_get(addr, "/readyz").unwrap_or_default()
        })
        .await
        .unwrap();
        if last.1.contains("ResourceSlices") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(last.0, 503, "{last:?}");
    assert!(last.1.contains("ResourceSlices not published"), "{last:?}");
    lab.api.clear_fault(refused);
    let mut ready = false;
    for _ in 0..150 {
        let (code, _) = tokio::task::spawn_blocking(move || {
            support::http_get(addr, "/readyz").unwrap_or_default()
        })
        .await
        .unwrap();
        if code == 200 {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        ready,
        "readyz never turned 200 once the API server accepted the slices"
    );
    assert!(!lab.slices().is_empty());
    let (_, metrics) = tokio::task::spawn_blocking(move || {
        support::http_get(addr, "/metrics").unwrap_or_default()
    })
    .await
    .unwrap();
    let created = support::metric_value(&metrics, "gpuplane_slice_writes_total{op=\"create\"}")
        .unwrap_or_else(|| panic!("no slice write counter in {metrics}"));
    assert!(created >= lab.slices().len() as f64, "{metrics}");
    agent.stop().await.unwrap();
}

/// Issue 22: until the kubelet's PodResources has told a (re)started agent what the device
/// plugin holds, the agent writes no ResourceSlice (the previous agent's, with their in-use
/// taints, stay) and prepares no claim (the kubelet retries); its first answer lifts both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_slice_is_written_and_no_claim_prepared_before_pod_resources_answers() {
    let mut lab = Lab::new("dgx-h100").await;
    // The device-plugin side of the kubelet (registration and PodResources) is not there.
    lab.kubelet.stop().await;
    let agent = lab.start("");
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    let claim = lab.claim("early", &["gpu-0"]);
    let err = lab.prepare(&claim).await.unwrap_err();
    assert!(
        err.contains("does not know yet which devices the device plugin API holds"),
        "{err}"
    );
    assert!(lab.slices().is_empty(), "{:?}", lab.slices());
    assert_eq!(lab.api.count_requests("POST", "/resourceslices"), 0);
    lab.kubelet.restart().await.unwrap();
    lab.eventually("slices published once PodResources answers", |l| {
        !l.slices().is_empty()
    })
    .await;
    assert_eq!(lab.prepare(&claim).await.unwrap().len(), 1);
    lab.unprepare(&claim).await;
    agent.stop().await;
}
