//! Dynamic MIG deployed as users deploy gpuplane (issue 38): daemonset/ through the deployment
//! overlay of tests/lab/deploy.rs on the three-node lab, lab-node-3 simulating the
//! dynamic-mig-mixed machine with `dynamicMig` on for its GPUs 0 and 1. A claim's MIG instance,
//! made by one agent pod's prepare, is still there for the agent pod of the next build after a
//! rolling update (a driver keeps instances across agent restarts; the simulated machine keeps
//! them in the state dir for the same boot, node::kept_sim), and that agent destroys it when
//! the claim's pod goes.

use crate::cluster::{self, eventually, image, ClusterLab, AGENT_NS};
use crate::deploy::{
    agent_pods, agents_ready, apply_overlay_with, controllers_ready, lab_with_image, pod_phase,
    rollout,
};
use crate::deploy_mps::config_patch;

const NODE: &str = "lab-node-3";

fn deploy(lab: &ClusterLab, image_ref: &str) {
    apply_overlay_with(
        lab,
        image_ref,
        "",
        &[config_patch("dynamicMig:\n  gpus: [0, 1]\n")],
    );
}

/// `gpuplane_dynamic_mig_instances{gpu="<gpu>"}` from lab-node-3's agent pod, once it answers.
fn instances(lab: &ClusterLab, gpu: u32) -> Option<u64> {
    let pod = agent_pods(lab).into_iter().find(|p| p.0 == NODE && p.2)?.1;
    let ip = lab.get_json(&["get", "pod", &pod, "-n", AGENT_NS])?["status"]["podIP"]
        .as_str()?
        .to_string();
    let out = lab
        .in_netns("curl")
        .args(["-sf", &format!("http://{ip}:9400/metrics")])
        .output()
        .ok()?;
    let want = format!("gpuplane_dynamic_mig_instances{{gpu=\"{gpu}\"}} ");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix(&want)?.trim().parse().ok())
}

#[test]
fn a_claims_mig_instance_outlives_an_agent_upgrade_and_goes_with_the_claim() {
    let Some((lab, built)) = lab_with_image("1") else {
        return;
    };
    lab.kubectl_ok(&[
        "label",
        "node",
        NODE,
        "gpuplane.dev/simulate=dynamic-mig-mixed",
        "--overwrite",
    ]);
    deploy(&lab, &built.reference);
    agents_ready(&lab);
    controllers_ready(&lab);
    eventually("lab-node-3's dynamic MIG devices published", || {
        let slices = lab.get_json(&["get", "resourceslices"])?;
        slices["items"]
            .as_array()?
            .iter()
            .filter(|s| s["spec"]["nodeName"] == NODE)
            .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
            .any(|d| d["name"] == "gpu-0-mig-3g40gb-at4")
            .then_some(())
    });
    let cel = "device.attributes[\"gpu.gpuplane.dev\"].profile == \"3g.40gb\" && device.attributes[\"gpu.gpuplane.dev\"].parentIndex == 0";
    let extra = [format!("selectors: [{{cel: {{expression: '{cel}'}}}}]")];
    lab.apply(&cluster::claim_template_of(
        "default",
        "mig",
        "mig.gpuplane.dev",
        &extra,
    ));
    lab.apply(&cluster::claim_pod("default", "mig", "mig"));
    cluster::wait_running(&lab, "default", "mig");
    eventually("the instance made", || {
        (instances(&lab, 0)? == 1).then_some(())
    });

    let second = image::build(&lab.work, "2", "2").unwrap();
    lab.import_image(&second.tar);
    deploy(&lab, &second.reference);
    rollout(&lab);
    let agent = agent_pods(&lab)
        .into_iter()
        .find(|p| p.0 == NODE)
        .unwrap()
        .1;
    let log = lab.kubectl_ok(&["logs", &agent, "-n", AGENT_NS]);
    assert!(log.contains("build=2"), "{log}");
    assert_eq!(
        instances(&lab, 0),
        Some(1),
        "the new agent does not have the claim's instance:\n{log}"
    );
    assert_eq!(
        pod_phase(&lab, "default", "mig").as_deref(),
        Some("Running")
    );

    lab.kubectl_ok(&["delete", "pod", "mig", "--wait=true", "--timeout=120s"]);
    eventually("the instance destroyed by the new agent", || {
        (instances(&lab, 0)? == 0).then_some(())
    });
}
