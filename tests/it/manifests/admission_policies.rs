//! The ValidatingAdmissionPolicies, evaluated as the API server's CEL does: what the node agent
//! may do to MPS daemon pods and the controller to namespaces and pods.

use super::*;

#[test]
fn the_node_agent_may_create_and_delete_only_mps_daemon_pods_of_its_own_node() {
    let docs = docs();
    let policy = "gpuplane-node-mps-pods";
    let agent = "system:serviceaccount:gpuplane-system:gpuplane-node";
    let request = |op: &str, user: &str, node: &str| {
        json!({"operation": op, "subResource": "", "userInfo": {"username": user,
            "extra": {"authentication.kubernetes.io/node-name": [node]}}})
    };
    // The pod the agent renders (crates/model/src/mps_pod.rs), every field the policy reads.
    let daemonset = find(&docs, "DaemonSet", Some(NS), "gpuplane-node").unwrap();
    let agent_pod = gpuplane_model::mps_pod::AgentPod {
        namespace: NS.into(),
        image: daemonset.value["spec"]["template"]["spec"]["containers"][0]["image"]
            .as_str()
            .unwrap()
            .into(),
        ..Default::default()
    };
    let daemon = |node: &str| {
        let pod = gpuplane_model::mps_pod::DaemonPod {
            node,
            unit: "GPU-1",
            multiuser: true,
            agent: &agent_pod,
            state_dir: "/var/lib/gpuplane",
            driver_root: "/run/nvidia/driver",
            driver_root_mount: "/run/nvidia/driver",
            nvml_lib: Some("/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
        };
        serde_json::to_value(pod.render()).unwrap()
    };
    let null = Value::Null;
    let deny = |op: &str, node: &str, pod: &Value| {
        let (old, new) = if op == "DELETE" {
            (pod, &null)
        } else {
            (&null, pod)
        };
        policy_denials_of(&docs, policy, &request(op, agent, node), old, new).expect("matches")
    };
    let own = daemon("node-a");
    assert_eq!(deny("CREATE", "node-a", &own), Vec::<String>::new());
    assert_eq!(deny("DELETE", "node-a", &own), Vec::<String>::new());
    // (This evaluator leaves messageExpression out; the real API server words it.)
    assert_eq!(deny("CREATE", "node-b", &own).len(), 1);
    assert_eq!(deny("DELETE", "node-b", &own).len(), 1);
    // Anything else than a daemon pod, on its own node too.
    let mut shell = own.clone();
    shell["spec"]["containers"][0]["args"] = json!(["node"]);
    assert_eq!(deny("CREATE", "node-a", &shell).len(), 1);
    let mut other_image = own.clone();
    other_image["spec"]["containers"][0]["image"] = json!("attacker/shell:1");
    assert_eq!(deny("CREATE", "node-a", &other_image).len(), 1);
    let mut unlabelled = own.clone();
    unlabelled["metadata"]["labels"] = json!({"app": "x"});
    assert_eq!(deny("CREATE", "node-a", &unlabelled).len(), 1);
    assert_eq!(deny("DELETE", "node-a", &unlabelled).len(), 1);
    // Other users are not this policy's business.
    let admin = request("CREATE", "kubernetes-admin", "");
    assert!(policy_denials_of(&docs, policy, &admin, &null, &shell).is_none());
}

#[test]
fn the_controller_may_change_only_the_queue_label_of_a_namespace() {
    let docs = docs();
    let policy = "gpuplane-controller-namespaces";
    let controller = "system:serviceaccount:gpuplane-system:gpuplane-controller";
    // Every optional field the policy reads is present: the cel crate fails `.?` on a missing
    // key where Kubernetes' CEL yields none (the real-cluster tier runs the policy itself).
    let namespace = |labels: Value, annotations: Value, finalizers: Value| {
        json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "team-a", "labels": labels, "annotations": annotations,
                "finalizers": ["example.com/keep"]},
            "spec": {"finalizers": finalizers}})
    };
    let k = ["kubernetes"];
    let old = namespace(json!({"team": "a"}), json!({"owner": "x"}), json!(k));
    let labelled = namespace(
        json!({"team": "a", "quota.gpuplane.dev/queue": "true"}),
        json!({"owner": "x"}),
        json!(k),
    );
    let deny = |old: &Value, new: &Value| {
        let d = policy_denials(&docs, policy, (controller, ""), old, new).expect("matches");
        !d.is_empty()
    };
    assert!(!deny(&old, &labelled), "adding the label");
    assert!(!deny(&labelled, &old), "removing it");
    assert!(!deny(&old, &old), "a no-op");
    let mut changed = vec![
        (
            "another label",
            namespace(json!({"team": "b"}), json!({"owner": "x"}), json!(k)),
        ),
        (
            "exempting the namespace",
            namespace(
                json!({"team": "a", "quota.gpuplane.dev/exempt": "true"}),
                json!({"owner": "x"}),
                json!(k),
            ),
        ),
        (
            "dropping a label",
            namespace(json!({}), json!({"owner": "x"}), json!(k)),
        ),
        (
            "an annotation",
            namespace(json!({"team": "a"}), json!({"owner": "y"}), json!(k)),
        ),
        (
            "the spec",
            namespace(json!({"team": "a"}), json!({"owner": "x"}), json!([])),
        ),
        (
            "another value of the label",
            namespace(
                json!({"team": "a", "quota.gpuplane.dev/queue": "false"}),
                json!({"owner": "x"}),
                json!(k),
            ),
        ),
    ];
    let mut unfinalized = old.clone();
    unfinalized["metadata"]["finalizers"] = json!([]);
    changed.push(("a metadata finalizer", unfinalized));
    for (what, new) in &changed {
        assert!(deny(&old, new), "the controller changing {what} is allowed");
    }
    // Anyone else is not this policy's business.
    let admin = policy_denials(&docs, policy, ("kubernetes-admin", ""), &old, &changed[0].1);
    assert_eq!(admin, None);
}

#[test]
fn the_controller_may_change_only_its_gate_and_its_conditions_of_a_pod() {
    use gpuplane_cluster::controller::explainer::CONDITION as EXPLAIN_CONDITION;
    use gpuplane_cluster::controller::pods::CONDITION as QUOTA_CONDITION;
    use gpuplane_model::quota::SCHEDULING_GATE;
    let docs = docs();
    let policy = "gpuplane-controller-pods";
    let controller = "system:serviceaccount:gpuplane-system:gpuplane-controller";
    let condition = |ty: &str, status: &str| json!({"type": ty, "status": status});
    // Every optional field the policy reads is present (see the namespace policy's test).
    let old = json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "labels": {"team": "a"}, "annotations": {},
            "finalizers": [], "ownerReferences": []},
        "spec": {"containers": [{"name": "c", "image": "app:1"}], "initContainers": [],
            "tolerations": [], "nodeSelector": {}, "affinity": {},
            "activeDeadlineSeconds": 60, "terminationGracePeriodSeconds": 30,
            "schedulingGates": [{"name": SCHEDULING_GATE}, {"name": "example.com/other"}]},
        "status": {"phase": "Pending", "message": "", "reason": "", "nominatedNodeName": "",
            "hostIP": "", "hostIPs": [], "podIP": "", "podIPs": [], "startTime": "",
            "qosClass": "BestEffort", "containerStatuses": [], "initContainerStatuses": [],
            "ephemeralContainerStatuses": [], "resourceClaimStatuses": [],
            "conditions": [condition("PodScheduled", "False")]}});
    let denied = |sub: &str, new: &Value| {
        policy_denials(&docs, policy, (controller, sub), &old, new).expect("matches")
    };
    let with = |path: &[&str], v: Value| {
        let mut new = old.clone();
        let (last, parents) = path.split_last().unwrap();
        let mut at = &mut new;
        for p in parents {
            at = &mut at[*p];
        }
        at[*last] = v;
        new
    };
    // What the controller writes: its gate off, its two conditions on.
    let ungated = with(
        &["spec", "schedulingGates"],
        json!([{"name": "example.com/other"}]),
    );
    assert_eq!(denied("", &ungated), Vec::<String>::new());
    let conditions = json!([
        condition("PodScheduled", "False"),
        condition(QUOTA_CONDITION, "False"),
        condition(EXPLAIN_CONDITION, "False"),
    ]);
    let own = with(&["status", "conditions"], conditions);
    assert_eq!(denied("status", &own), Vec::<String>::new());
    // Everything else RBAC would let through.
    let refused = [
        (
            "",
            with(
                &["spec", "schedulingGates"],
                json!([{"name": SCHEDULING_GATE}]),
            ),
        ),
        ("", with(&["spec", "schedulingGates"], json!([]))),
        (
            "",
            with(
                &["spec", "containers"],
                json!([{"name": "c", "image": "evil:1"}]),
            ),
        ),
        (
            "",
            with(&["spec", "tolerations"], json!([{"operator": "Exists"}])),
        ),
        ("", with(&["metadata", "labels"], json!({"team": "b"}))),
        (
            "status",
            with(
                &["status", "conditions"],
                json!([condition("PodScheduled", "True")]),
            ),
        ),
        ("status", with(&["status", "phase"], json!("Failed"))),
        (
            "status",
            with(&["status", "nominatedNodeName"], json!("node-b")),
        ),
    ];
    for (sub, new) in &refused {
        assert_eq!(denied(sub, new).len(), 1, "allowed through {sub:?}: {new}");
    }
    // Anyone else is not this policy's business.
    assert_eq!(
        policy_denials(&docs, policy, ("kubernetes-admin", ""), &old, &refused[2].1),
        None
    );
}
