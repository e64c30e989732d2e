//! The allocation ledger across both kubelet APIs: no device held by both, ended pods free their
//! GPUs, partitioned mode, and a restart rebuilds the same ledger.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_is_never_held_by_both_apis_at_once() {
    let lab = Lab::new("a100-mig-mixed").await;
    let agent = lab.start("flags: {migStrategy: mixed}\nallocation: {podResourcesGrace: 1s}\n");
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.kubelet
        // Registered is not yet listed: admission needs the first ListAndWatch answer.
        .wait_for(WAIT, |p| {
            p.get("nvidia.com/gpu").is_some_and(|v| v.healthy() > 0)
        })
        .await
        .unwrap();
    // GPU 3 (MIG off) through the device plugin...
    let (ids, _) = lab
        .kubelet
        .admit("team-b", "pod-1", "main", "nvidia.com/gpu", 1)
        .await
        .unwrap();
    lab.eventually("the in-use taint on gpu-3", |l| {
        l.taints("gpu-3") == ["gpu.gpuplane.dev/device-plugin=in-use"]
    })
    .await;
    // ...so a claim for it is refused, naming the holder.
    let claim = lab.claim("late", &["gpu-3"]);
    let err = lab.prepare(&claim).await.unwrap_err();
    assert!(
        err.contains("gpu-3") && err.contains("device plugin"),
        "{err}"
    );
    // The pod ends; PodResources stops listing it; after the grace period the claim gets it.
    lab.kubelet.end_pod("team-b", "pod-1");
    lab.eventually("the taint gone", |l| l.taints("gpu-3").is_empty())
        .await;
    lab.prepare(&claim).await.unwrap();
    // Now the device plugin side sees it withdrawn and Allocate is refused naming the claim.
    let id = ids[0].clone();
    lab.kubelet
        .wait_for(WAIT, |p| {
            p["nvidia.com/gpu"]
                .devices
                .iter()
                .any(|d| d.id == id && d.health == "Unhealthy")
        })
        .await
        .unwrap();
    let err = lab
        .kubelet
        .allocate("nvidia.com/gpu", &ids)
        .await
        .unwrap_err();
    assert!(
        err.message().contains("ResourceClaim team-a/late"),
        "{}",
        err.message()
    );
    // A MIG device of GPU 0 held by a claim blocks nothing else on the device plugin side
    // (GPU 0 is not offered whole), but the same MIG device cannot go to a container.
    lab.unprepare(&claim).await;
    lab.kubelet
        .wait_for(WAIT, |p| p["nvidia.com/gpu"].healthy() == 1)
        .await
        .unwrap();
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_whose_pod_ended_goes_to_a_claim_after_one_poll_not_after_the_grace_period() {
    const GPU: &str = "nvidia.com/gpu";
    const IN_USE: &str = "gpu.gpuplane.dev/device-plugin=in-use";
    let lab = Lab::new("dgx-h100").await;
    let agent = lab.start("allocation: {podResourcesGrace: 30s}\n");
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.kubelet
        .wait_for(WAIT, |p| p.get(GPU).is_some_and(|v| v.healthy() == 8))
        .await
        .unwrap();
    let inv = lab.sim.discover().unwrap().inventory;
    let name_of = |uuid: &str| {
        let g = inv.gpus.iter().find(|g| g.uuid == uuid).unwrap();
        format!("gpu-{}", g.index)
    };
    let (ids, _) = lab
        .kubelet
        .admit("team-b", "pod-1", "main", GPU, 1)
        .await
        .unwrap();
    let used = name_of(&ids[0]);
    // Another GPU Allocated with no assignment recorded: PodResources never lists it, as when
    // the kubelet has not got that far yet. The grace period must keep protecting it.
    let unlisted_uuid = inv
        .gpus
        .iter()
        .find(|g| g.uuid != ids[0])
        .unwrap()
        .uuid
        .to_string();
    lab.kubelet
        .allocate(GPU, std::slice::from_ref(&unlisted_uuid))
        .await
        .unwrap();
    let unlisted = name_of(&unlisted_uuid);
    // While the pod runs a claim on its GPU is refused; once PodResources has been polled the
    // refusal names the container.
    let claim = lab.claim("next", &[&used]);
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let err = lab.prepare(&claim).await.unwrap_err();
        assert!(err.contains("held by"), "{err}");
        if err.contains("team-b/pod-1/main") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "PodResources never named the pod: {err}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    lab.eventually("the in-use taint on the pod's GPU", |l| {
        l.taints(&used) == [IN_USE]
    })
    .await;
    // The pod ends: the next poll (500 ms apart) releases its GPU. Retry as the kubelet does,
    // within a bound far below the 30 s grace period.
    lab.kubelet.end_pod("team-b", "pod-1");
    let ended = std::time::Instant::now();
    let bound = Duration::from_secs(5);
    let answer = loop {
        let answer = lab.prepare(&claim).await;
        if answer.is_ok() || ended.elapsed() > bound {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        answer.is_ok(),
        "the claim was still refused {:?} after the pod ended (grace 30 s): {answer:?}",
        ended.elapsed()
    );
    lab.eventually("the in-use taint gone", |l| l.taints(&used).is_empty())
        .await;
    // A sync ran after the unlisted Allocate (it released the pod's GPU), and still that
    // Allocate is held: it was never listed and its grace period is not over.
    let err = lab
        .prepare(&lab.claim("grab", &[&unlisted]))
        .await
        .unwrap_err();
    assert!(err.contains("device plugin allocation"), "{err}");
    assert_eq!(lab.taints(&unlisted), [IN_USE]);
    lab.unprepare(&claim).await;
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_mode_gives_each_api_only_its_own_devices() {
    let lab = Lab::new("a100-mig-mixed").await;
    let agent =
        lab.start("flags: {migStrategy: mixed}\nallocation: {mode: partitioned, migToDra: true}\n");
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    let plugins = lab
        .kubelet
        .wait_for(WAIT, |p| p.contains_key("nvidia.com/gpu"))
        .await
        .unwrap();
    assert_eq!(
        plugins.keys().collect::<Vec<_>>(),
        ["nvidia.com/gpu"],
        "no MIG resources on the device plugin side"
    );
    lab.eventually("10 MIG devices in slices", |l| {
        l.slices()
            .iter()
            .map(|s| s["spec"]["devices"].as_array().map_or(0, Vec::len))
            .sum::<usize>()
            == 10
    })
    .await;
    assert!(
        Lab::device(&lab.slices(), "gpu-3").is_none(),
        "the whole GPU belongs to the device plugin"
    );
    let claim = lab.claim("wrong-side", &["gpu-3"]);
    assert!(lab.prepare(&claim).await.is_err());
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_rebuilds_the_same_ledger_from_pod_resources_and_the_checkpoint() {
    let lab = Lab::new("dgx-h100").await;
    let config = "allocation: {podResourcesGrace: 1s}\n";
    let agent = lab.start(config);
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.kubelet
        .wait_for(WAIT, |p| {
            p.get("nvidia.com/gpu")
                .is_some_and(|v| v.devices.len() == 8)
        })
        .await
        .unwrap();
    let (pod_ids, _) = lab
        .kubelet
        .admit("team-b", "pod-1", "main", "nvidia.com/gpu", 2)
        .await
        .unwrap();
    let inv = lab.sim.discover().unwrap().inventory;
    let free: Vec<String> = inv
        .gpus
        .iter()
        .filter(|g| !pod_ids.iter().any(|id| g.uuid == *id))
        .map(|g| format!("gpu-{}", g.index))
        .collect();
    let claim = lab.claim("keep", &[&free[0], &free[1]]);
    lab.prepare(&claim).await.unwrap();
    // What the ledger shows from the outside: withdrawn device-plugin devices, in-use taints.
    let view = |l: &Lab| {
        let withdrawn: Vec<String> = l
            .kubelet
            .plugin("nvidia.com/gpu")
            .map(|v| {
                v.devices
                    .iter()
                    .filter(|d| d.health == "Unhealthy")
                    .map(|d| d.id.clone())
                    .collect()
            })
            .unwrap_or_default();
        let tainted: Vec<String> = (0..8)
            .map(|i| format!("gpu-{i}"))
            .filter(|d| !l.taints(d).is_empty())
            .collect();
        (withdrawn, tainted)
    };
    lab.eventually("both kinds of hold visible", |l| {
        let (w, t) = view(l);
        w.len() == 2 && t.len() == 2
    })
    .await;
    let before = view(&lab);
    agent.stop().await;
    let restarted = tokio::time::Instant::now();
    let agent = lab.start(config);
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.kubelet
        .wait_for(WAIT, |p| {
            p.get("nvidia.com/gpu").is_some_and(|v| v.healthy() == 6)
        })
        .await
        .unwrap();
    // Past the grace period (real time), a PodResources listing and a publisher round, the
    // view must still be the same. The listing: one the kubelet answered after the grace, seen
    // applied (the agent sent the next one). Then an Xid on a free GPU: once ListAndWatch and
    // the slices show it, they show all the agent did before it.
    tokio::time::sleep_until(restarted + Duration::from_secs(1)).await;
    let lists = lab.kubelet.pod_resources_lists();
    lab.eventually("a PodResources listing past the grace", |l| {
        l.kubelet.pod_resources_lists() >= lists + 2
    })
    .await;
    let marker = inv
        .gpus
        .iter()
        .find(|g| format!("gpu-{}", g.index) == free[2])
        .unwrap();
    let (marker_id, marker_name) = (marker.uuid.to_string(), free[2].clone());
    lab.sim.inject_xid(&marker.uuid, None, 48);
    lab.eventually("the Xid in ListAndWatch and in the slices", |l| {
        let (withdrawn, tainted) = view(l);
        withdrawn.contains(&marker_id) && tainted.contains(&marker_name)
    })
    .await;
    let (mut withdrawn, mut tainted) = view(&lab);
    withdrawn.retain(|d| *d != marker_id);
    tainted.retain(|d| *d != marker_name);
    assert_eq!((withdrawn, tainted), before);
    // And the holds are enforced, not just shown: each API is refused the other's devices.
    let err = lab
        .prepare(&lab.claim("grab", &[&before.1[0]]))
        .await
        .unwrap_err();
    assert!(err.contains("held by"), "{err}");
    let claimed = inv
        .gpus
        .iter()
        .find(|g| format!("gpu-{}", g.index) == free[0])
        .unwrap()
        .uuid
        .to_string();
    let err = lab
        .kubelet
        .allocate("nvidia.com/gpu", &[claimed])
        .await
        .unwrap_err();
    assert!(
        err.message().contains("ResourceClaim team-a/keep"),
        "{}",
        err.message()
    );
    agent.stop().await;
}

/// Issue 22: the kubelet records a container's devices as soon as Allocate returns, so with
/// the default config a pod that ends before any PodResources listing saw it frees its GPU at
/// the first listing a second later, not after a long grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_ends_before_any_listing_saw_it_frees_its_gpu_within_seconds() {
    const GPU: &str = "nvidia.com/gpu";
    let lab = Lab::new("dgx-h100").await;
    let agent = lab.start("");
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.kubelet
        .wait_for(WAIT, |p| p.get(GPU).is_some_and(|v| v.healthy() == 8))
        .await
        .unwrap();
    let inv = lab.sim.discover().unwrap().inventory;
    let (ids, _) = lab
        .kubelet
        .admit("team-b", "short", "main", GPU, 1)
        .await
        .unwrap();
    lab.kubelet.end_pod("team-b", "short");
    let ended = std::time::Instant::now();
    let gpu = inv.gpus.iter().find(|g| g.uuid == ids[0]).unwrap();
    let claim = lab.claim("after-short", &[&format!("gpu-{}", gpu.index)]);
    // Retried as the kubelet does. The bound separates "the next listings" from the 30 s
    // such a hold used to outlive its pod; it is no latency target.
    let bound = Duration::from_secs(10);
    loop {
        match lab.prepare(&claim).await {
            Ok(_) => break,
            Err(e) => {
                assert!(e.contains("held by"), "{e}");
                assert!(
                    ended.elapsed() < bound,
                    "still held {:?} after its pod ended: {e}",
                    ended.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    lab.unprepare(&claim).await;
    agent.stop().await;
}

/// With the device plugin off (`gpuplane.dev/apis=dra`) the agent still follows PodResources:
/// a pod that another device plugin placed (NVIDIA's, or this agent under an earlier config)
/// keeps its GPU. The first slices already carry the in-use taint, a claim on that GPU is
/// refused naming the container, and once the pod ends the GPU goes to the claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dra_only_agent_never_hands_out_a_gpu_another_device_plugin_placed_a_pod_on() {
    const IN_USE: &str = "gpu.gpuplane.dev/device-plugin=in-use";
    let lab = Lab::new("pcie-l4x4").await;
    lab.api
        .put_json(json!({"apiVersion": "v1", "kind": "Node",
               "metadata": {"name": NODE, "labels": {"gpuplane.dev/apis": "dra"}}}))
        .unwrap();
    let inv = lab.sim.discover().unwrap().inventory;
    let gpu = inv.gpus.iter().find(|g| g.index == 1).unwrap();
    lab.kubelet.assign(
        "team-b",
        "legacy",
        "main",
        "nvidia.com/gpu",
        &[gpu.uuid.to_string()],
    );
    let agent = lab.start("");
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.eventually("slices published", |l| !l.slices().is_empty())
        .await;
    assert_eq!(lab.taints("gpu-1"), [IN_USE], "the first slices taint it");
    assert!(lab.taints("gpu-0").is_empty());
    let claim = lab.claim("grab", &["gpu-1"]);
    let err = lab.prepare(&claim).await.unwrap_err();
    assert!(err.contains("team-b/legacy/main"), "{err}");
    assert!(
        lab.kubelet.registrations().is_empty(),
        "the device plugin registered on a DRA-only node"
    );
    lab.kubelet.end_pod("team-b", "legacy");
    lab.eventually("the in-use taint gone", |l| l.taints("gpu-1").is_empty())
        .await;
    lab.prepare(&claim).await.unwrap();
    lab.unprepare(&claim).await;
    agent.stop().await;
}
