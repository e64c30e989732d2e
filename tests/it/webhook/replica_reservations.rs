//! Whole controller replicas: reservations turn into usage once their pods exist, expire when
//! they never appear, and back off past the cap; pods waiting for their claim template.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_seen_turns_its_reservation_into_usage_at_once_while_another_waits_out_its_grace() {
    let api = ApiServerDouble::start().await.unwrap();
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"nvidia.com/gpu": 4}}, "mode": "Reject"}),
    )
    .await;
    let pki = Pki::new();
    // Default grace (2 minutes) and a resync far away: only the pod's own event can bring
    // the namespace's next reconcile forward.
    let r = controller_replica_with_grace(
        &api,
        &pki,
        "r1",
        false,
        None,
        Some(Duration::from_secs(600)),
    )
    .await;
    let tls = pki.client_config();
    for name in ["ghost", "p-0"] {
        let r = response(
            &post(
                &tls,
                r.webhook().addr(),
                "/validate",
                &pod_review(&format!("uid-{name}"), gpu_pod(name, "nvidia.com/gpu", 1)),
            )
            .await,
        );
        assert_eq!(r["allowed"], true);
    }
    // The loop has seen both reservations (and set its next deadline to the ghost's grace): it
    // decides on a fresh list of the namespace's GpuQuotas, and one came after both were
    // written (the webhook answers once its write is done).
    let written = api.requests().len();
    let quota_list = format!("/namespaces/{NS}/gpuquotas");
    eventually_async(
        "the loop's list of the quotas after both reservations",
        LIMIT,
        || async {
            api.requests()[written..].iter().any(|(method, path)| {
                let (path, query) = path.split_once('?').unwrap_or((path, ""));
                method == "GET" && path.ends_with(&quota_list) && !query.contains("watch=")
            })
        },
    )
    .await;
    api.put_json(gpu_pod("p-0", "nvidia.com/gpu", 1)).unwrap();
    eventually_async("p-0's reservation to turn into usage", LIMIT, || async {
        let s = stored_quota(&api, "q").status.unwrap_or_default();
        let names: Vec<&str> = s.reservations.iter().map(|r| r.name.as_str()).collect();
        names == ["ghost"] && s.used.devices.get("nvidia.com/gpu") == Some(&1)
    })
    .await;
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reservations_become_usage_once_their_pods_exist_and_expire_when_they_never_appear() {
    let api = ApiServerDouble::start().await.unwrap();
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"nvidia.com/gpu": 4}}, "mode": "Reject"}),
    )
    .await;
    let pki = Pki::new();
    let r =
        controller_replica_with_grace(&api, &pki, "r1", false, Some(Duration::from_secs(3)), None)
            .await;
    let tls = pki.client_config();
    let addr = r.webhook().addr();
    let admit = |name: &'static str| {
        let tls = tls.clone();
        async move {
            response(
                &post(
                    &tls,
                    addr,
                    "/validate",
                    &pod_review(&format!("uid-{name}"), gpu_pod(name, "nvidia.com/gpu", 1)),
                )
                .await,
            )
        }
    };
    for name in ["p-0", "p-1", "p-2", "ghost"] {
        assert_eq!(admit(name).await["allowed"], true);
    }
    let full = admit("extra").await;
    assert_eq!(
        full["status"]["message"],
        "devices[nvidia.com/gpu]: requested 1, used 4 of 4 in GpuQuota team-a/q"
    );
    // Three of them are created (pending: not scheduled yet); "ghost" never is.
    for name in ["p-0", "p-1", "p-2"] {
        api.put_json(gpu_pod(name, "nvidia.com/gpu", 1)).unwrap();
    }
    let state = || {
        let s = stored_quota(&api, "q").status.unwrap_or_default();
        let names: Vec<String> = s.reservations.iter().map(|r| r.name.clone()).collect();
        (
            names,
            s.used.devices.get("nvidia.com/gpu").copied().unwrap_or(0),
        )
    };
    eventually_async(
        "the pods' reservations to turn into usage",
        LIMIT,
        || async {
            let (names, used) = state();
            used == 3 && names.iter().all(|n| n == "ghost")
        },
    )
    .await;
    eventually_async("the ghost's reservation to expire", LIMIT, || async {
        state() == (vec![], 3)
    })
    .await;
    // The numbers are the same as before: one more fits, the next is denied.
    assert_eq!(admit("p-3").await["allowed"], true);
    let full = admit("p-4").await;
    assert_eq!(
        full["status"]["message"],
        "devices[nvidia.com/gpu]: requested 1, used 4 of 4 in GpuQuota team-a/q"
    );
    r.stop().await;
}

/// One client creating pods one after another: after the first admission, the replica admits
/// within its escrow (no write waited for), records those admissions in few writes, never more
/// than `hard`, and gives its escrow back when idle, leaving one reservation per admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_steady_stream_is_admitted_within_an_escrow_with_few_writes_and_exactly() {
    let api = ApiServerDouble::start().await.unwrap();
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"nvidia.com/gpu": 100}}}),
    )
    .await;
    let pki = Pki::new();
    let hook = replica(&api, &pki).await;
    let tls = pki.client_config();
    let mut admitted = 0;
    let mut denials = std::collections::BTreeSet::new();
    for i in 0..120 {
        let body = pod_review(
            &format!("uid-{i}"),
            gpu_pod(&format!("p-{i}"), "nvidia.com/gpu", 1),
        );
        let r = response(&post(&tls, hook.addr(), "/validate", &body).await);
        if r["allowed"] == true {
            admitted += 1;
        } else {
            denials.insert(
                r["status"]["message"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            );
        }
    }
    let escrowed = hook
        .commits
        .escrowed
        .load(std::sync::atomic::Ordering::Relaxed);
    let writes = api.count_requests("PUT", "/gpuquotas/q/status");
    eprintln!(
        "120 one by one: {admitted} admitted, {escrowed} within an escrow, {writes} status writes"
    );
    assert_eq!(admitted, 100, "{denials:?}");
    assert_eq!(
        denials.into_iter().collect::<Vec<_>>(),
        ["devices[nvidia.com/gpu]: requested 1, used 100 of 100 in GpuQuota team-a/q"]
    );
    assert!(escrowed >= 50, "{escrowed} admitted within an escrow");
    assert!(writes <= 60, "{writes} writes for 100 admissions");
    // Operators see the same counts.
    let (code, metrics) = get(hook.metrics_addr().unwrap(), "/metrics").await;
    assert_eq!(code, 200);
    assert_eq!(
        sample(&metrics, "gpuplane_webhook_escrow_admissions_total"),
        Some(escrowed as f64),
        "{metrics}"
    );
    let webhook_writes = sample(&metrics, "gpuplane_webhook_status_writes_total").unwrap_or(0.0);
    assert!(
        webhook_writes >= 1.0 && webhook_writes <= writes as f64,
        "{metrics}"
    );
    let t = std::time::Instant::now();
    let mut status = stored_quota(&api, "q").status.unwrap();
    while !status.escrows.is_empty() && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
        status = stored_quota(&api, "q").status.unwrap();
    }
    assert!(
        status.escrows.is_empty(),
        "idle escrow kept: {:?}",
        status.escrows
    );
    assert_eq!(status.reservations.len(), 100);
    assert_eq!(status.reserved.devices["nvidia.com/gpu"], 100);
    hook.stop().await;
}

/// Issue 28: a pod naming a ResourceClaimTemplate not created yet (`kubectl apply -f dir/` in
/// the wrong order) is admitted gated and charged nothing, in Reject mode too; once the
/// template exists the controller prices the pod from it and keeps it gated with the quota's
/// reason while it does not fit, or releases it into the quota's usage.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_whose_template_is_not_created_yet_waits_gated_and_is_charged_once_it_exists() {
    let api = ApiServerDouble::start().await.unwrap();
    seed_devices(&api);
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"mig.gpuplane.dev": 1}}, "mode": "Reject"}),
    )
    .await;
    let pki = Pki::new();
    let r = controller_replica(&api, &pki, "r1", false).await;
    let tls = pki.client_config();
    let addr = r.webhook().addr();
    let w = pod(
        "w",
        json!({"containers": [{"name": "main", "image": "cuda"}],
               "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]}),
    );
    let waiting = "waiting for ResourceClaimTemplate team-a/t to be created";
    // The mutating webhook gates it and says why.
    let m = response(&post(&tls, addr, "/mutate", &pod_review("u1", w.clone())).await);
    assert_eq!(m["allowed"], true, "{m}");
    assert_eq!(m["patchType"], "JSONPatch", "{m}");
    assert!(m["warnings"][0].as_str().unwrap().contains(waiting), "{m}");
    // Ungated (the mutating webhook was away), it is denied as before: fail closed.
    let v = response(&post(&tls, addr, "/validate", &pod_review("u2", w.clone())).await);
    assert_eq!(v["allowed"], false, "{v}");
    assert!(v["status"]["message"].as_str().unwrap().contains(
        "ResourceClaimTemplate team-a/t not found, and the pod arrived without the scheduling gate"
    ));
    // Gated, it is admitted and charged nothing.
    let mut gated = w;
    gated["spec"]["schedulingGates"] = json!([{"name": SCHEDULING_GATE}]);
    let v = response(&post(&tls, addr, "/validate", &pod_review("u3", gated.clone())).await);
    assert_eq!(v["allowed"], true, "{v}");
    assert!(v["warnings"][0].as_str().unwrap().contains(waiting), "{v}");
    let s = stored_quota(&api, "q").status.unwrap_or_default();
    assert!(s.reservations.is_empty() && s.reserved.is_zero(), "{s:?}");
    // Only the controller removes the gate, in Reject mode too.
    let mut ungated = gated.clone();
    ungated["spec"]["schedulingGates"] = json!([]);
    let upd = serde_json::to_vec(&review(
        "u4",
        ("", "v1", "Pod"),
        "UPDATE",
        ungated,
        Some(gated.clone()),
        "alice",
    ))
    .unwrap();
    let v = response(&post(&tls, addr, "/validate", &upd).await);
    assert_eq!(v["allowed"], false, "{v}");

    api.put_json(gated).unwrap();
    let condition = |api: &ApiServerDouble| -> Option<(bool, String)> {
        let p = api.get_json("v1", "pods", Some(NS), "w")?;
        let gated = p["spec"]["schedulingGates"]
            .as_array()
            .is_some_and(|g| !g.is_empty());
        let c = p["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "QuotaAdmitted")?
            .clone();
        Some((gated, c["message"].as_str()?.to_string()))
    };
    eventually_async("the pod told it waits for its template", LIMIT, || async {
        condition(&api).is_some_and(|(g, m)| g && m.contains(waiting))
    })
    .await;
    // The template arrives asking for two MIG devices: more than the quota ever allows.
    let template = |count: u32| {
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": "t", "namespace": NS},
            "spec": {"spec": {"devices": {"requests": [{"name": "m", "exactly":
                {"deviceClassName": "mig.gpuplane.dev", "allocationMode": "ExactCount", "count": count}}]}}}})
    };
    api.put_json(template(2)).unwrap();
    eventually_async(
        "the pod kept gated with the quota's reason",
        LIMIT,
        || async {
            condition(&api).is_some_and(|(g, m)| {
                g && m.contains("devices[mig.gpuplane.dev]") && m.contains("GpuQuota team-a/q")
            })
        },
    )
    .await;
    assert!(stored_quota(&api, "q")
        .status
        .unwrap_or_default()
        .used
        .is_zero());
    // One device fits: released, and charged once, through the pod.
    api.put_json(template(1)).unwrap();
    eventually_async("the pod released and counted in used", LIMIT, || async {
        let s = stored_quota(&api, "q").status.unwrap_or_default();
        condition(&api).is_some_and(|(g, _)| !g)
            && s.used.devices.get("mig.gpuplane.dev") == Some(&1)
            && s.reservations.is_empty()
    })
    .await;
    r.stop().await;
}

/// Past `MAX_RESERVATIONS` admitted-but-unseen pods the webhook refuses with a retryable 429
/// naming the GpuQuota; the status stays bounded; once the controller sees the pods (and drops
/// their entries), admissions resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_the_reservation_cap_admissions_back_off_until_the_controller_catches_up() {
    use gpuplane_model::quota::escrow::MAX_UNFLUSHED;
    use gpuplane_model::quota::MAX_RESERVATIONS;
    let api = ApiServerDouble::start().await.unwrap();
    quota(
        &api,
        "q",
        json!({"hard": {"devices": {"nvidia.com/gpu": 100_000}}}),
    )
    .await;
    let pki = Pki::new();
    let r = controller_replica(&api, &pki, "r1", false).await;
    let tls = pki.client_config();
    let admit = |i: usize| {
        let tls = tls.clone();
        let addr = r.webhook().addr();
        async move {
            let name = format!("p-{i}");
            let body = pod_review(&format!("uid-{name}"), gpu_pod(&name, "nvidia.com/gpu", 1));
            response(&post(&tls, addr, "/validate", &body).await)
        }
    };
    // Nothing is stored: the controller sees none of the pods, so every entry stays.
    let mut admitted = 0;
    let refusal = loop {
        let a = admit(admitted).await;
        if a["allowed"] != true {
            break a;
        }
        admitted += 1;
        assert!(admitted <= MAX_RESERVATIONS, "admitted past the cap");
    };
    assert!(
        admitted >= MAX_RESERVATIONS - MAX_UNFLUSHED,
        "{admitted} admitted"
    );
    assert_eq!(refusal["status"]["code"], 429, "{refusal}");
    let why = refusal["status"]["message"].as_str().unwrap_or_default();
    assert!(
        why.contains("GpuQuota team-a/q") && why.contains("try again"),
        "{why}"
    );
    let status = stored_quota(&api, "q").status.unwrap();
    let bytes = serde_json::to_vec(&status).unwrap().len();
    assert!(status.reservations.len() <= MAX_RESERVATIONS);
    assert!(bytes < 256 * 1024, "{bytes} bytes");
    assert_eq!(status.reserved.devices["nvidia.com/gpu"], admitted as u64);

    // The pods are created: the controller counts them and drops their entries.
    for i in 0..admitted {
        api.put_json(gpu_pod(&format!("p-{i}"), "nvidia.com/gpu", 1))
            .unwrap();
    }
    eventually_async("the entries of seen pods to go", LIMIT, || async {
        let s = stored_quota(&api, "q").status.unwrap_or_default();
        s.reservations.is_empty()
            && s.used.devices.get("nvidia.com/gpu") == Some(&(admitted as u64))
    })
    .await;
    assert_eq!(admit(admitted).await["allowed"], true, "admissions resume");
    r.stop().await;
}
