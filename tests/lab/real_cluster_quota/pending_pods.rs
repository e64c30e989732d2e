//! Pods the quota and the scheduler agree on: one applied before its claim template waits for
//! it, CEL selectors pick the same devices, and one asking too many GPUs says why it is pending.

use super::*;

/// The `QuotaAdmitted` condition's message, if the controller wrote one.
fn quota_note(pod: &Value) -> Option<String> {
    pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "QuotaAdmitted")?["message"]
        .as_str()
        .map(String::from)
}

/// Issue 28: `kubectl apply` of a pod before its ResourceClaimTemplate (a directory applied in
/// the wrong order, GitOps) in a governed namespace, Reject mode: the pod is created gated and
/// told it waits for the template; once the template exists the pod runs, charged once (a
/// quota of exactly one GPU), and a pod whose template asks for more than the quota allows
/// stays gated with the quota's reason instead.
#[test]
fn a_pod_applied_before_its_claim_template_waits_for_it_then_runs() {
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    let installed = lab.install(true);
    let _agent = LabAgent::start(&lab, &installed.agent, "1");
    let _controller = start_controller(&lab, &installed, "1");
    cluster::wait_controller_ready(&lab);
    namespace_with_quota(&lab, "team-t", "gpus", 1, "Reject");
    for (pod, template) in [("early", "one-gpu"), ("big", "two-gpus")] {
        let p = lab
            .create(&cluster::claim_pod("team-t", pod, template), &[])
            .unwrap();
        assert_eq!(gates(&p), [SCHEDULING_GATE], "created gated: {p}");
        let waiting = format!("waiting for ResourceClaimTemplate team-t/{template} to be created");
        eventually(&format!("pod {pod} told it waits for {template}"), || {
            let p = pod_json(&lab, "team-t", pod)?;
            quota_note(&p)?.contains(&waiting).then_some(())
        });
    }
    let p = pod_json(&lab, "team-t", "early").unwrap();
    assert_eq!(scheduled_reason(&p).as_deref(), Some("SchedulingGated"));
    let q = lab
        .get_json(&["get", "gpuquota", "default", "-n", "team-t"])
        .unwrap();
    assert!(
        q["status"]["reservations"]
            .as_array()
            .is_none_or(|r| r.is_empty()),
        "nothing charged while waiting: {}",
        q["status"]
    );
    lab.apply(&cluster::claim_template_of(
        "team-t",
        "one-gpu",
        "gpu.gpuplane.dev",
        &[],
    ));
    lab.apply(&cluster::claim_template_of(
        "team-t",
        "two-gpus",
        "gpu.gpuplane.dev",
        &[
            "allocationMode: ExactCount".to_string(),
            "count: 2".to_string(),
        ],
    ));
    cluster::wait_running(&lab, "team-t", "early");
    eventually("pod big kept gated with the quota's reason", || {
        let p = pod_json(&lab, "team-t", "big")?;
        let note = quota_note(&p)?;
        (gates(&p) == [SCHEDULING_GATE]
            && note.contains("can never be admitted")
            && note.contains("GpuQuota team-t/default"))
        .then_some(())
    });
    eventually("one GPU used in team-t, charged once", || {
        let q = lab.get_json(&["get", "gpuquota", "default", "-n", "team-t"])?;
        let used = &q["status"]["used"]["gpus"];
        (used == 1 || used == "1").then_some(())
    });
}

/// Quota prices a claim by the devices its selectors may match; the scheduler allocates from
/// the ones they do match. Both now run a real CEL engine, so they must agree: on the
/// a100-mig-mixed node (MIG devices of four profiles on three GPUs), a claim of DeviceClass
/// `mig.gpuplane.dev` with `allocationMode: All` and each expression gets from the real
/// scheduler exactly the devices quota's catalog matches with the same expression, read from
/// the same slices and classes. The expressions use what the old hand-written subset could not
/// read (`in`, `has`, regex, semver, quantity arithmetic).
#[test]
fn quota_and_the_scheduler_select_the_same_devices_with_each_cel_expression() {
    use gpuplane_model::quota::{selector::Selector, CatalogSettings, ClassMatch, DeviceCatalog};
    use std::collections::BTreeSet;
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    let kubeconfig = lab.install_agent_identity();
    let _agent = LabAgent::start_with(
        &lab,
        &kubeconfig,
        "cel",
        &["--simulate", "a100-mig-mixed", "--device-plugin=false"],
        &[],
        None,
    );
    let a = r#"device.attributes["gpu.gpuplane.dev"]"#;
    let mem = r#"device.capacity["gpu.gpuplane.dev"].memory"#;
    let expressions = [
        format!(r#"{a}.profile == "1g.5gb""#),
        format!(r#"{a}.profile in ["2g.10gb", "4g.20gb"]"#),
        format!(r#"{mem}.compareTo(quantity("10Gi")) >= 0 && {mem}.isLessThan(quantity("20Gi"))"#),
        format!(r#"{a}.profile.matches("^[34]g[.]")"#),
        format!(r#"has({a}.parentIndex) && {a}.parentIndex == 1"#),
        format!(
            r#"{a}.driverVersion.isGreaterThan(semver("535.0.0")) && {a}.profile.startsWith("1g")"#
        ),
        format!(r#"{a}.profile.endsWith(".5gb") || {a}["profile"] == "3g.20gb""#),
    ];
    let devices = eventually("the MIG devices in lab-node's slices", || {
        let d = cluster::node_devices(&lab);
        (d.len() > 8).then_some(d)
    });
    let slices: Vec<k8s_openapi::api::resource::v1::ResourceSlice> = cluster::node_slices(&lab)
        .into_iter()
        .map(|s| serde_json::from_value(s).unwrap())
        .collect();
    let classes: Vec<k8s_openapi::api::resource::v1::DeviceClass> =
        lab.get_json(&["get", "deviceclasses"]).unwrap()["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| serde_json::from_value(c.clone()).unwrap())
            .collect();
    let catalog = DeviceCatalog::new(&slices, &classes, CatalogSettings::default());
    for (i, expr) in expressions.iter().enumerate() {
        let selector = Selector::parse(expr);
        assert!(selector.understood(), "{expr}");
        let ClassMatch::Devices(matched) = catalog.matching("mig.gpuplane.dev", &[selector]) else {
            panic!("quota does not know DeviceClass mig.gpuplane.dev");
        };
        let quota_view: BTreeSet<String> = matched.iter().map(|d| d.name.clone()).collect();
        assert!(
            !quota_view.is_empty() && quota_view.len() < devices.len(),
            "{expr}: pick expressions that split the node's devices, not {quota_view:?}"
        );
        let name = format!("cel-{i}");
        let extra = [
            "allocationMode: All".to_string(),
            format!("selectors: [{{cel: {{expression: '{expr}'}}}}]"),
        ];
        lab.apply(&cluster::claim_template_of(
            "default",
            &name,
            "mig.gpuplane.dev",
            &extra,
        ));
        lab.apply(&cluster::claim_pod("default", &name, &name));
        let scheduler_view: BTreeSet<String> = cluster::eventually_or(
            &format!("the claim of pod {name} allocated"),
            || {
                let claims = lab.get_json(&["get", "resourceclaims"])?;
                let claim = claims["items"]
                    .as_array()?
                    .iter()
                    .find(|c| c["metadata"]["ownerReferences"][0]["name"] == name.as_str())?;
                let results = claim["status"]["allocation"]["devices"]["results"].as_array()?;
                Some(
                    results
                        .iter()
                        .filter_map(|r| r["device"].as_str().map(String::from))
                        .collect(),
                )
            },
            || lab.describe_pod(&name),
        );
        assert_eq!(scheduler_view, quota_view, "{expr}");
        // Frees the devices for the next All-mode claim.
        lab.kubectl_ok(&["delete", "pod", &name, "--wait=true"]);
    }
}

/// Issue 26 in the controller: a pod asking 9 GPUs of the 8-GPU lab node carries why it is
/// Pending as the condition `gpuplane.dev/GPUsAvailable` (the numbers `gpuplane explain`
/// gives), one Event with the reason, and counts in `gpuplane_pending_gpu_pods`. The
/// controller runs with the installed RBAC, so its node watch is checked for real.
#[test]
fn a_pod_asking_more_gpus_than_the_cluster_has_carries_why_it_is_pending() {
    let Some(lab) = ClusterLab::start() else {
        return;
    };
    let installed = lab.install(true);
    let _agent = LabAgent::start(&lab, &installed.agent, "1");
    let controller = start_controller(&lab, &installed, "1");
    cluster::wait_controller_ready(&lab);
    eventually("node lab-node to report nvidia.com/gpu: 8", || {
        let node = lab.get_json(&["get", "node", NODE])?;
        (node["status"]["allocatable"]["nvidia.com/gpu"] == "8").then_some(())
    });
    lab.create(&pod("default", "nine", 9), &[]).unwrap();
    let cond = eventually("the GPUsAvailable condition on pod nine", || {
        let p = pod_json(&lab, "default", "nine")?;
        let conds = p["status"]["conditions"].as_array()?.clone();
        conds
            .into_iter()
            .find(|c| c["type"] == "gpuplane.dev/GPUsAvailable" && c["reason"] == "Capacity")
    });
    assert_eq!(cond["status"], "False", "{cond}");
    assert_eq!(
        cond["message"], "needs 9 nvidia.com/gpu; 8 free in the cluster",
        "{cond}"
    );
    let events = eventually("a Capacity Event for pod nine", || {
        let items = cluster::pod_events(&lab, "default", "nine", "Capacity");
        (!items.is_empty()).then_some(items)
    });
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["type"], "Warning", "{:?}", events[0]);
    eventually("gpuplane_pending_gpu_pods{reason=Capacity} 1", || {
        let text = controller_metrics(&lab);
        text.lines()
            .any(|l| l == "gpuplane_pending_gpu_pods{reason=\"Capacity\"} 1")
            .then_some(())
    });
    let log = controller.log_text();
    assert!(
        refusals(&log).is_empty(),
        "the controller was refused a call:\n{log}"
    );
}
