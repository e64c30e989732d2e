//! A hung inventory refresh or a hung probe of a lost GPU holds up no health change, config
//! reload or kubelet call.

use super::*;

/// An inventory refresh that hangs (NVML stalls) holds up only the next refresh: the state
/// owner keeps turning. While the refresh is held, an Xid still marks a GPU unhealthy and it
/// recovers after the quiet period, a config change still applies (time-slicing replicas in
/// ListAndWatch), Allocate answers, and `/healthz` stays healthy past the time after which it
/// would call the agent stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_inventory_refresh_holds_up_no_health_change_config_reload_or_kubelet_call() {
    const GPU: &str = "nvidia.com/gpu";
    let lab = Lab::new("dgx-h100").await;
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], support::free_port()).into();
    let config = "health: {inventoryRefresh: 1s, recoveryQuietPeriod: 1s}\n";
    let agent = lab.start_agent_serving(config, Some(addr)).unwrap();
    let view = lab
        .kubelet
        .wait_for(WAIT, |p| p.get(GPU).is_some_and(|v| v.healthy() == 8))
        .await
        .unwrap();
    assert_eq!(view[GPU].devices.len(), 8);
    let inv = lab.sim.discover().unwrap().inventory;
    let stall = lab.sim.stall_discovery();
    // Hang guard, as in the probe test: released late, the ordering assertion fails instead.
    let guard = stall.clone();
    std::thread::spawn(move || {
        std::thread::sleep(WAIT * 3);
        guard.release();
    });
    let held = stall.clone();
    let refreshing = tokio::task::spawn_blocking(move || held.wait_entered(WAIT))
        .await
        .unwrap();
    assert!(refreshing, "the agent never refreshed its inventory");

    let uuid = inv.gpus[5].uuid.clone();
    let health = |want: &'static str| {
        let uuid = uuid.clone();
        move |p: &BTreeMap<String, PluginView>| {
            p[GPU]
                .devices
                .iter()
                .any(|d| d.id == uuid && d.health == want)
        }
    };
    lab.sim.inject_xid(&uuid, None, 48);
    lab.kubelet
        .wait_for(WAIT, health("Unhealthy"))
        .await
        .expect("an Xid marks the GPU unhealthy while a refresh hangs");
    lab.kubelet
        .wait_for(WAIT, health("Healthy"))
        .await
        .expect("the GPU recovers after the quiet period while a refresh hangs");
    std::fs::write(
        lab.root().join("config.yaml"),
        format!("{config}sharing: {{timeSlicing: {{resources: [{{name: nvidia.com/gpu, replicas: 2}}]}}}}\n"),
    )
    .unwrap();
    lab.kubelet
        .wait_for(WAIT, |p| p.get(GPU).is_some_and(|v| v.devices.len() == 16))
        .await
        .expect("a config change applies while a refresh hangs");
    let replica = lab.kubelet.plugins()[GPU].devices[0].id.clone();
    let grant = lab.kubelet.allocate(GPU, &[replica]).await;
    assert!(!grant.unwrap().cdi_devices.is_empty());
    // Past the stuck threshold, /healthz still says the agent turns.
    tokio::time::sleep(gpuplane_node::node::http::STUCK_AFTER + Duration::from_secs(1)).await;
    let healthz = tokio::task::spawn_blocking(move || support::http_get(addr, "/healthz"))
        .await
        .unwrap();
    assert_eq!(healthz.map(|(code, _)| code), Some(200));
    assert!(
        !stall.released(),
        "the checks above passed only after the hung refresh was released"
    );
    assert_eq!(stall.entered(), 1, "one refresh at a time");
    stall.release();
    agent.stop().await.unwrap();
}

/// A probe of a lost GPU that hangs (NVML does, for a GPU off the bus) holds up nothing else.
/// The probe blocks until the test releases it, and the test releases it only after
/// ListAndWatch reported the GPU unhealthy and Allocate, GetPreferredAllocation,
/// NodePrepareResources and /metrics answered: each answer came while the probe hung. Once the
/// probe returns, its answer is applied (the GPU recovers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_probe_of_a_lost_gpu_holds_up_no_kubelet_call_and_its_answer_still_counts() {
    const GPU: &str = "nvidia.com/gpu";
    let lab = Lab::new("dgx-h100").await;
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], support::free_port()).into();
    let agent = lab.start_agent_serving("", Some(addr)).unwrap();
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    let view = lab
        .kubelet
        .wait_for(WAIT, |p| p.get(GPU).is_some_and(|v| v.healthy() == 8))
        .await
        .unwrap();
    lab.eventually("slices published", |l| !l.slices().is_empty())
        .await;
    let ids: Vec<String> = view[GPU].devices.iter().map(|d| d.id.clone()).collect();
    let inv = lab.sim.discover().unwrap().inventory;
    let lost = inv.gpus[3].uuid.clone();

    let stall = lab.sim.stall_probes();
    // Hang guard: an agent that probed under its state lock would block the runtime this test
    // shares with it; released late, the answers below come after the probe returned and the
    // ordering assertion fails instead of the test hanging.
    let guard = stall.clone();
    std::thread::spawn(move || {
        std::thread::sleep(WAIT * 2);
        guard.release();
    });
    lab.sim.set_lost(&lost, true);
    let held = stall.clone();
    let probing = tokio::task::spawn_blocking(move || held.wait_entered(WAIT))
        .await
        .unwrap();
    assert!(probing, "the agent never probed the lost GPU");

    // Everything below answers while the probe is held.
    let l = &lab;
    lab.kubelet
        .wait_for(WAIT, |p| {
            p[GPU]
                .devices
                .iter()
                .any(|d| d.id == lost && d.health == "Unhealthy")
        })
        .await
        .expect("ListAndWatch reports the lost GPU while its probe hangs");
    let answered = tokio::time::timeout(WAIT, async {
        let grant = l.kubelet.allocate(GPU, &ids[..1]).await;
        let healthy: Vec<String> = ids.iter().filter(|i| **i != lost).cloned().collect();
        let preferred = l.kubelet.preferred(GPU, &healthy[1..], &[], 2).await;
        let claim = l.claim("while-probing", &["gpu-5"]);
        let prepared = l.prepare(&claim).await;
        let metrics =
            tokio::task::spawn_blocking(move || support::http_get(addr, "/metrics")).await;
        (grant, preferred, prepared, metrics)
    })
    .await
    .expect("kubelet calls and /metrics answer while a probe hangs");
    assert!(
        !stall.released(),
        "the kubelet calls answered only after the hung probe was released"
    );
    let (grant, preferred, prepared, metrics) = answered;
    assert!(!grant.unwrap().cdi_devices.is_empty());
    assert_eq!(preferred.unwrap().len(), 2);
    assert_eq!(prepared.unwrap().len(), 1);
    assert_eq!(metrics.unwrap().map(|(code, _)| code), Some(200));
    assert_eq!(stall.entered(), 1, "one probe round at a time");

    // The GPU answers again; the held probe returns and its answer is applied.
    lab.sim.set_lost(&lost, false);
    stall.release();
    lab.kubelet
        .wait_for(WAIT, |p| {
            p[GPU]
                .devices
                .iter()
                .any(|d| d.id == lost && d.health == "Healthy")
        })
        .await
        .expect("the lost GPU recovers once its probe returns");
    agent.stop().await.unwrap();
}
