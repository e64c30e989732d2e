//! Whole controller replicas: /readyz tells leader from follower through an API outage, and
//! /metrics counts admissions, denials, the queue and usage per GpuQuota.

use super::*;

/// Waits until `/readyz` of `r` has a line starting with `prefix`; returns the answer.
async fn readyz_until(r: &Replica, prefix: &str) -> (u16, String) {
    let start = std::time::Instant::now();
    loop {
        let answer = readyz(r).await;
        if answer.1.lines().any(|l| l.starts_with(prefix)) {
            return answer;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for readyz to say {prefix:?}; last:\n{}",
            answer.1
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readyz_tells_leader_from_follower_and_reports_an_api_outage_while_answering() {
    let api = ApiServerDouble::start().await.unwrap();
    let pki = Pki::new();
    let a = controller_replica(&api, &pki, "replica-a", true).await;
    let (status, body) = readyz_until(&a, "role: leader").await;
    assert_eq!(status, 200, "{body}");
    let lines: Vec<&str> = body.lines().collect();
    assert_eq!(lines[0], "ready", "{body}");
    assert_eq!(lines[1], "webhook: serving", "{body}");
    assert!(
        lines[2].starts_with("api: reachable (last answer "),
        "{body}"
    );
    assert_eq!(lines[3], "role: leader (runs the quota loops)", "{body}");
    // The same answer over HTTPS on the webhook's port.
    let tls = pki.client_config();
    let https = raw(
        &tls,
        a.webhook().addr(),
        "GET /readyz HTTP/1.1\r\nHost: localhost".into(),
        Vec::new(),
    )
    .await;
    assert_eq!(https.status, 200);
    assert!(https.text().contains("role: leader"), "{}", https.text());
    let (status, body) = get(a.webhook().metrics_addr().unwrap(), "/healthz").await;
    assert_eq!((status, body.as_str()), (200, "ok\n"));

    let b = controller_replica(&api, &pki, "replica-b", true).await;
    let (status, body) = readyz_until(&b, "role: follower (leader: replica-a)").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("ready\nwebhook: serving\napi: reachable"),
        "{body}"
    );
    let (_, m) = get(b.webhook().metrics_addr().unwrap(), "/metrics").await;
    assert!(m.contains("\ngpuplane_controller_leader 0\n"), "{m}");
    assert!(m.contains("\ngpuplane_controller_api_reachable 1\n"), "{m}");

    // The API server goes away: both stay ready, say so, and keep answering from their caches;
    // the leader cannot renew the Lease and steps down.
    let outage = api.inject(Fault::status("*", "/", 500));
    api.drop_watches();
    for r in [&a, &b] {
        let (status, body) = readyz_until(r, "api: away").await;
        assert_eq!(status, 200, "{body}");
        assert!(
            body.starts_with("ready, degraded: the API server is away; answering from the last known state\nwebhook: serving\n"),
            "{body}"
        );
        assert!(
            body.contains("GPU pods under a GpuQuota are denied until it is back"),
            "{body}"
        );
        readyz_until(r, "role: follower").await;
        let cpu = pod("cpu", json!({"containers": [{"name": "c", "image": "x"}]}));
        let answer = post(
            &tls,
            r.webhook().addr(),
            "/validate",
            &pod_review("u-cpu", cpu),
        )
        .await;
        assert_eq!(response(&answer)["allowed"], true);
    }
    let (_, m) = get(a.webhook().metrics_addr().unwrap(), "/metrics").await;
    assert!(m.contains("\ngpuplane_controller_api_reachable 0\n"), "{m}");

    // Back: reachable again, and one of them leads.
    api.clear_fault(outage);
    for r in [&a, &b] {
        let (status, body) = readyz_until(r, "api: reachable").await;
        assert_eq!(status, 200, "{body}");
        assert!(body.starts_with("ready\n"), "{body}");
    }
    eventually_async("a leader again", LIMIT, || async {
        let (_, ra) = readyz(&a).await;
        let (_, rb) = readyz(&b).await;
        ra.contains("role: leader") != rb.contains("role: leader")
    })
    .await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_count_admissions_denials_queue_and_usage_per_gpuquota() {
    let api = ApiServerDouble::start().await.unwrap();
    // Reject mode in team-a: room for two GPUs.
    quota(
        &api,
        "gold",
        json!({"hard": {"devices": {"nvidia.com/gpu": 2}}, "mode": "Reject"}),
    )
    .await;
    // Queue mode in team-q: two GPUs, one held by a running pod.
    api.put_json(
        json!({"apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"name": "queue", "namespace": "team-q"},
        "spec": {"hard": {"gpus": 2}, "mode": "Queue"}}),
    )
    .unwrap();
    let queued = |name: &str, gated: bool| {
        let mut spec = json!({"containers": [{"name": "main", "image": "cuda",
            "resources": {"limits": {"nvidia.com/gpu": "1"}}}]});
        if gated {
            spec["schedulingGates"] = json!([{"name": SCHEDULING_GATE}]);
        } else {
            spec["nodeName"] = json!("node-1");
        }
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "team-q", "uid": format!("uid-{name}")},
            "spec": spec})
    };
    api.put_json(queued("running", false)).unwrap();
    let pki = Pki::new();
    let r = controller_replica(&api, &pki, "replica-m", false).await;
    let tls = pki.client_config();
    for i in 0..3 {
        let body = pod_review(
            &format!("u{i}"),
            gpu_pod(&format!("p{i}"), "nvidia.com/gpu", 1),
        );
        let allowed =
            response(&post(&tls, r.webhook().addr(), "/validate", &body).await)["allowed"] == true;
        assert_eq!(allowed, i < 2, "pod {i}");
    }
    for name in ["q0", "q1", "q2"] {
        api.put_json(queued(name, true)).unwrap();
    }
    let addr = r.webhook().metrics_addr().unwrap();
    let wanted = [
        ("gpuplane_quota_queue_length{namespace=\"team-q\",quota=\"queue\"}", 2.0),
        ("gpuplane_quota_released_total{namespace=\"team-q\",quota=\"queue\"}", 1.0),
        ("gpuplane_quota_reserved{namespace=\"team-a\",quota=\"gold\",resource=\"devices[nvidia.com/gpu]\"}", 2.0),
    ];
    // One queued pod released, two waiting, the reservations seen by the cache. The released
    // pod is charged once: reserved until the controller's cache counts it in `used` (when
    // that happens is the cache's timing, so either state passes, never both or neither).
    let team_q = |m: &str, what: &str| {
        sample(
            m,
            &format!(
                "gpuplane_quota_{what}{{namespace=\"team-q\",quota=\"queue\",resource=\"gpus\"}}"
            ),
        )
    };
    let start = std::time::Instant::now();
    let m = loop {
        let m = get(addr, "/metrics").await.1;
        let charged_once = team_q(&m, "reserved")
            .zip(team_q(&m, "used"))
            .map(|(r, u)| r + u)
            == Some(2.0);
        if charged_once
            && wanted
                .iter()
                .all(|(series, want)| sample(&m, series) == Some(*want))
        {
            break m;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out; last:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let at = |ns: &str, q: &str| format!("{{namespace=\"{ns}\",quota=\"{q}\"}}");
    for (series, want) in [
        (format!("gpuplane_quota_admissions_total{}", at(NS, "gold")), 2.0),
        (format!("gpuplane_quota_denials_total{}", at(NS, "gold")), 1.0),
        ("gpuplane_webhook_decision_seconds_count{webhook=\"validate\"}".to_string(), 3.0),
        ("gpuplane_webhook_admissions_total{webhook=\"validate\",result=\"denied\"}".to_string(), 1.0),
        (format!("gpuplane_quota_wait_seconds_count{}", at("team-q", "queue")), 1.0),
        ("gpuplane_quota_hard{namespace=\"team-a\",quota=\"gold\",resource=\"devices[nvidia.com/gpu]\"}".to_string(), 2.0),
        ("gpuplane_quota_used{namespace=\"team-a\",quota=\"gold\",resource=\"devices[nvidia.com/gpu]\"}".to_string(), 0.0),
        ("gpuplane_quota_hard{namespace=\"team-q\",quota=\"queue\",resource=\"gpus\"}".to_string(), 2.0),
        ("gpuplane_quota_pods_released_total".to_string(), 1.0),
        ("gpuplane_controller_leader".to_string(), 1.0),
    ] {
        assert_eq!(sample(&m, &series), Some(want), "{series} in:\n{m}");
    }
    assert!(m.ends_with("\n# EOF\n"), "one OpenMetrics exposition:\n{m}");
    // Every series sits under its family's TYPE line, once (OpenMetrics names a counter's
    // family without the `_total` of its samples).
    for family in [
        "gpuplane_quota_admissions counter",
        "gpuplane_quota_wait_seconds histogram",
        "gpuplane_webhook_decision_seconds histogram",
        "gpuplane_quota_queue_length gauge",
        "gpuplane_quota_used gauge",
    ] {
        assert_eq!(
            m.matches(&format!("# TYPE {family}\n")).count(),
            1,
            "{family} in:\n{m}"
        );
    }
    r.stop().await;
}
