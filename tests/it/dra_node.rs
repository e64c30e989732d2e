//! The DRA driver end to end (see tests/support/lab.rs for the set-up), and the allocation
//! ledger across both kubelet APIs.

use crate::support;

use crate::lab::{Lab, DRIVER, NODE, WAIT};
use gpuplane_model::source::DeviceSource;
use gpuplane_node::dra::ClaimRef;
use gpuplane_node::proto::dra_health_v1::HealthStatus;
use gpuplane_testkit::doubles::apiserver::Fault;
use gpuplane_testkit::doubles::kubelet::PluginView;
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Duration;

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

/// The node's GPU labels follow the inventory and the config: GFD's names appear, a config
/// change moves them (time-slicing replicas), `nodeLabels: {enabled: false}` removes them, and
/// labels that are not ours are never touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_labels_follow_the_inventory_and_the_config() {
    let lab = Lab::new("pcie-l4x4").await;
    lab.api
        .put_json(json!({"apiVersion": "v1", "kind": "Node",
                         "metadata": {"name": NODE, "labels": {"team": "a", "nvidia.com/gpu.present": "true"}}}))
        .unwrap();
    let labels = || -> serde_json::Value {
        lab.api.get_json("v1", "nodes", None, NODE).unwrap()["metadata"]["labels"].clone()
    };
    let agent = lab.start("");
    lab.eventually("GFD's labels on the node", |_| {
        labels()["nvidia.com/gpu.count"] == "4"
    })
    .await;
    let l = labels();
    assert_eq!(l["nvidia.com/gpu.product"], "NVIDIA-L4", "{l}");
    assert_eq!(l["nvidia.com/gpu.family"], "ada-lovelace", "{l}");
    assert_eq!(l["nvidia.com/gpu.replicas"], "1");
    let config = lab.root().join("config.yaml");
    std::fs::write(
        &config,
        "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}\n",
    )
    .unwrap();
    lab.eventually("the replicas label to follow the config", |_| {
        labels()["nvidia.com/gpu.replicas"] == "4"
    })
    .await;
    assert_eq!(labels()["nvidia.com/gpu.sharing-strategy"], "time-slicing");
    std::fs::write(&config, "nodeLabels: {enabled: false}\n").unwrap();
    lab.eventually("our labels removed", |_| {
        labels()
            .as_object()
            .is_some_and(|m| !m.contains_key("nvidia.com/gpu.count"))
    })
    .await;
    let l = labels();
    assert_eq!(l["team"], "a", "{l}");
    assert_eq!(l["nvidia.com/gpu.present"], "true", "not ours: {l}");
    agent.stop().await;
}

/// The node's `gpuplane.dev/apis` label chooses the kubelet APIs (here DRA only: slices and
/// DRA registration, no device plugin); a change of it stops the agent (the DaemonSet starts
/// it again with the new APIs); a value it does not know keeps it from starting, named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_label_chooses_the_apis_and_a_change_stops_the_agent() {
    let lab = Lab::new("pcie-l4x4").await;
    let node = |apis: &str| {
        json!({"apiVersion": "v1", "kind": "Node",
               "metadata": {"name": NODE, "labels": {"gpuplane.dev/apis": apis}}})
    };
    lab.api.put_json(node("dra")).unwrap();
    let addr = metrics_addr();
    let agent = lab.start_serving("", addr);
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.eventually("slices published", |l| !l.slices().is_empty())
        .await;
    // Ready: every API the agent serves is registered with the kubelet, so a device plugin
    // served here has registered by now (and its socket, served first, exists).
    wait_ready(addr).await;
    assert!(
        lab.kubelet.registrations().is_empty(),
        "the device plugin registered on a DRA-only node"
    );
    assert!(!lab.device_plugin_socket("nvidia.com/gpu").exists());

    lab.api.put_json(node("both")).unwrap();
    agent.ended().await.unwrap();
    let agent = lab.start("");
    lab.kubelet
        .wait_for(WAIT, |p| {
            p.get("nvidia.com/gpu").is_some_and(|v| v.healthy() == 4)
        })
        .await
        .unwrap();
    agent.stop().await;

    lab.api.put_json(node("DRA")).unwrap();
    let err = lab.start("").ended().await.unwrap_err();
    assert!(
        err.contains(
            "node node-a: label gpuplane.dev/apis=\"DRA\" is not one of device-plugin, dra, both"
        ),
        "{err}"
    );
}

/// The node's `gpuplane.dev/sharing` label turns consumable-capacity sharing on (with the
/// config's section, or its defaults) or off over the config; a change stops the agent; a value
/// it does not know keeps it from starting, named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_label_turns_sharing_on_or_off_over_the_config() {
    let lab = Lab::new("pcie-l4x4").await;
    let node = |sharing: &str| {
        json!({"apiVersion": "v1", "kind": "Node",
               "metadata": {"name": NODE, "labels": {"gpuplane.dev/sharing": sharing}}})
    };
    let shared = |l: &Lab| {
        l.slices()
            .iter()
            .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
            .filter(|d| d["allowMultipleAllocations"] == true)
            .map(|d| d["capacity"]["compute"]["requestPolicy"]["validRange"]["step"].clone())
            .collect::<Vec<_>>()
    };
    // On, with no section in the config: every GPU, the defaults (5% steps).
    lab.api.put_json(node("on")).unwrap();
    let agent = lab.start("");
    lab.eventually("4 shared GPUs with the default steps", |l| {
        shared(l) == vec![json!("5"); 4]
    })
    .await;
    // Off wins over the config's section.
    lab.api.put_json(node("off")).unwrap();
    agent.ended().await.unwrap();
    let section = "sharing:\n  consumableCapacity: {gpus: [0], computeStep: 10}\n";
    let agent = lab.start(section);
    lab.dra.wait_registered(DRIVER, WAIT).await.unwrap();
    lab.eventually("no shared GPU", |l| {
        l.slices().iter().any(|s| {
            s["spec"]["devices"]
                .as_array()
                .is_some_and(|d| d.len() == 4)
        }) && shared(l).is_empty()
    })
    .await;
    agent.stop().await;
    // On keeps the config's section.
    lab.api.put_json(node("on")).unwrap();
    let agent = lab.start(section);
    lab.eventually("gpu-0 shared in 10% steps", |l| {
        shared(l) == vec![json!("10")]
    })
    .await;
    agent.stop().await;
    lab.api.put_json(node("yes")).unwrap();
    let err = lab.start("").ended().await.unwrap_err();
    assert!(
        err.contains("node node-a: label gpuplane.dev/sharing=\"yes\" is not on or off"),
        "{err}"
    );
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

/// An address for an agent's `/metrics`, `/healthz` and `/readyz`.
fn metrics_addr() -> std::net::SocketAddr {
    ([127, 0, 0, 1], support::free_port()).into()
}

/// Waits until the agent serving on `addr` says it is ready.
async fn wait_ready(addr: std::net::SocketAddr) {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (code, body) = tokio::task::spawn_blocking(move || {
            support::http_get(addr, "/readyz").unwrap_or_default()
        })
        .await
        .unwrap();
        if code == 200 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the agent never turned ready: {code} {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
