//! Device health through DRA: an Xid taints the slice and the health stream (v1 and v1alpha1),
//! a v1beta1-only kubelet gets the same answers, and an Xid mark survives a restart.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xid_taints_the_slice_and_turns_the_health_stream_unhealthy_until_recovery() {
    let lab = Lab::new("dgx-h100").await;
    let agent = lab.start("health: {recoveryQuietPeriod: 1s}\n");
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.dra.watch_health(DRIVER).unwrap();
    lab.dra
        .wait_health(DRIVER, WAIT, |h| {
            h.health(NODE, "gpu-5") == Some(HealthStatus::Healthy)
        })
        .await
        .unwrap();
    lab.eventually("slices", |l| !l.slices().is_empty()).await;
    let uuid = lab.sim.discover().unwrap().inventory.gpus[5].uuid.clone();
    lab.sim.inject_xid(&uuid, None, 48);
    lab.eventually("a taint on gpu-5", |l| {
        l.taints("gpu-5") == ["gpu.gpuplane.dev/unhealthy=xid-48"]
    })
    .await;
    lab.dra
        .wait_health(DRIVER, WAIT, |h| {
            h.health(NODE, "gpu-5") == Some(HealthStatus::Unhealthy)
        })
        .await
        .unwrap();
    assert!(lab.taints("gpu-4").is_empty());
    lab.eventually("the taint gone", |l| l.taints("gpu-5").is_empty())
        .await;
    lab.dra
        .wait_health(DRIVER, WAIT, |h| {
            h.health(NODE, "gpu-5") == Some(HealthStatus::Healthy)
        })
        .await
        .unwrap();
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_health_streams_the_same_over_dra_health_v1_and_v1alpha1() {
    use gpuplane_node::proto::{dra_health_v1 as v1, dra_health_v1alpha1 as v1alpha1};
    use gpuplane_testkit::doubles::kubelet_dra::HealthVersion;

    let lab = Lab::new("dgx-h100").await;
    // A long quiet period: gpu-5 stays unhealthy while both streams are read.
    let agent = lab.start("health: {recoveryQuietPeriod: 10m}\n");
    let plugin = lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    let offered = &plugin.info.supported_versions;
    let at = |s: &str| offered.iter().position(|o| o == s);
    assert!(
        at("v1.DRAResourceHealth").is_some()
            && at("v1.DRAResourceHealth") < at("v1alpha1.DRAResourceHealth"),
        "{offered:?}"
    );
    // The (1.37) kubelet double picked v1.
    assert_eq!(plugin.health, Some(HealthVersion::V1));
    lab.dra.watch_health(DRIVER).unwrap();
    let uuid = lab.sim.discover().unwrap().inventory.gpus[5].uuid.clone();
    lab.sim.inject_xid(&uuid, None, 48);
    let seen = lab
        .dra
        .wait_health(DRIVER, WAIT, |h| {
            h.health(NODE, "gpu-5") == Some(HealthStatus::Unhealthy)
        })
        .await
        .unwrap();
    assert_eq!(seen.version, Some(HealthVersion::V1));

    // Two clients of our own on the DRA socket, one per version.
    let channel = gpuplane_node::grpc::connect(&plugin.endpoint)
        .await
        .unwrap();
    let mut v1_stream = v1::dra_resource_health_client::DraResourceHealthClient::new(channel)
        .node_watch_resources(v1::NodeWatchResourcesRequest {})
        .await
        .unwrap()
        .into_inner();
    let channel = gpuplane_node::grpc::connect(&plugin.endpoint)
        .await
        .unwrap();
    let mut alpha_stream =
        v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(channel)
            .node_watch_resources(v1alpha1::NodeWatchResourcesRequest {})
            .await
            .unwrap()
            .into_inner();
    let from_v1 = v1_stream.message().await.unwrap().unwrap();
    let from_alpha = alpha_stream.message().await.unwrap().unwrap();

    // (pool, device, health, message, timeout) per device; times may differ by a second.
    let v1_list: Vec<_> = from_v1
        .devices
        .iter()
        .map(|d| {
            let id = d.device.clone().unwrap();
            let health = v1::HealthStatus::try_from(d.health).unwrap().as_str_name();
            (
                id.pool_name,
                id.device_name,
                health,
                d.message.clone(),
                d.health_check_timeout_seconds,
            )
        })
        .collect();
    let alpha_list: Vec<_> = from_alpha
        .devices
        .iter()
        .map(|d| {
            let id = d.device.clone().unwrap();
            let health = v1alpha1::HealthStatus::try_from(d.health)
                .unwrap()
                .as_str_name();
            (
                id.pool_name,
                id.device_name,
                health,
                d.message.clone(),
                d.health_check_timeout_seconds,
            )
        })
        .collect();
    assert_eq!(v1_list.len(), 8, "{v1_list:?}");
    assert_eq!(v1_list, alpha_list);
    let gpu5 = v1_list.iter().find(|d| d.1 == "gpu-5").unwrap();
    assert_eq!((gpu5.0.as_str(), gpu5.2), (NODE, "UNHEALTHY"));
    assert!(gpu5.3.contains("48"), "{gpu5:?}");
    assert_eq!(
        v1_list.iter().filter(|d| d.2 == "HEALTHY").count(),
        7,
        "{v1_list:?}"
    );
    // And the same as the kubelet double's own stream.
    assert_eq!(seen.devices.len(), 8);
    for d in &from_v1.devices {
        let id = d.device.as_ref().unwrap();
        assert_eq!(
            seen.health(&id.pool_name, &id.device_name)
                .map(|h| h as i32),
            Some(d.health),
            "{}",
            id.device_name
        );
    }
    assert!(from_v1.devices[0].last_updated_time > 1_700_000_000);
    assert!(
        (from_v1.devices[0].last_updated_time - from_alpha.devices[0].last_updated_time).abs() <= 2
    );
    drop((v1_stream, alpha_stream));
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_that_speaks_only_dra_v1beta1_gets_the_same_answers() {
    use gpuplane_testkit::doubles::kubelet_dra::{DraVersion, KubeletDraOptions};
    let lab = Lab::with_kubelet("a100-mig-mixed", KubeletDraOptions::v1beta1_only()).await;
    let agent = lab.start("flags: {migStrategy: mixed}\n");
    let plugin = lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    assert_eq!(plugin.version, DraVersion::V1beta1);
    let claim = lab.claim("beta", &["gpu-0-mig-3g20gb-1", "gpu-3"]);
    let ids = lab.prepare(&claim).await.unwrap();
    assert_eq!(ids.len(), 2);
    assert_eq!(lab.prepare(&claim).await.unwrap(), ids);
    lab.unprepare(&claim).await;
    assert!(!lab
        .dir
        .path()
        .join(format!("cdi/gpuplane-claim-{}.json", claim.uid))
        .exists());
    agent.stop().await;
}

/// Health marks survive an agent restart: a GPU an Xid made unhealthy stays unhealthy after
/// the restart, in every ListAndWatch answer and with its taint, and the restart writes no
/// ResourceSlice; it recovers once its quiet period, counted from the Xid, has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_xid_mark_survives_an_agent_restart_until_its_quiet_period_passes() {
    const TAINT: &str = "gpu.gpuplane.dev/unhealthy=xid-48";
    let lab = Lab::new("dgx-h100").await;
    let config = "health: {recoveryQuietPeriod: 1h}\n";
    let agent = lab.start(config);
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.eventually("slices", |l| !l.slices().is_empty()).await;
    let uuid = lab.sim.discover().unwrap().inventory.gpus[5].uuid.clone();
    lab.sim.inject_xid(&uuid, None, 48);
    lab.eventually("a taint on gpu-5", |l| l.taints("gpu-5") == [TAINT])
        .await;
    let saved = lab.paths().state_dir.join("health-marks.json");
    lab.eventually("the mark saved", |_| {
        std::fs::read_to_string(&saved).is_ok_and(|t| t.contains(uuid.as_str()))
    })
    .await;
    agent.stop().await;

    let slice_writes = |lab: &Lab| {
        lab.api
            .requests()
            .into_iter()
            .filter(|(m, p)| m != "GET" && p.contains("/resourceslices"))
            .count()
    };
    let (writes, answered, registered) = (
        slice_writes(&lab),
        lab.kubelet.answers().len(),
        lab.kubelet.registrations().len(),
    );
    let addr = metrics_addr();
    let agent = lab.start_serving(config, addr);
    wait_ready(addr).await;
    assert!(lab.kubelet.registrations().len() > registered);
    let answers = lab.kubelet.answers()[answered..].to_vec();
    assert!(!answers.is_empty());
    for (resource, devices) in &answers {
        let d = devices.iter().find(|d| d.id == uuid.as_str()).unwrap();
        assert_eq!(d.health, "Unhealthy", "{resource}: {devices:?}");
    }
    assert_eq!(lab.taints("gpu-5"), [TAINT]);
    assert_eq!(slice_writes(&lab), writes, "the restart wrote slices");
    agent.stop().await;

    // A quiet period shorter than the mark's age (or about to be): it recovers.
    let agent = lab.start("health: {recoveryQuietPeriod: 1s}\n");
    lab.eventually("the taint gone", |l| l.taints("gpu-5").is_empty())
        .await;
    lab.kubelet
        .wait_for(WAIT, |p| p["nvidia.com/gpu"].healthy() == 8)
        .await
        .unwrap();
    agent.stop().await;
}
