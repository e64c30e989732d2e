//! The node's labels follow the inventory and the config, and the node label chooses the
//! kubelet APIs and turns sharing on or off.

use super::*;

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
