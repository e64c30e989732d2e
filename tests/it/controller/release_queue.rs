//! The queue that releases gated GPU pods: whole groups, priority then creation time, a bound on
//! waiting, reservations that settle, and many pods per cycle.

use super::*;

fn is_gated(p: &Pod) -> bool {
    p.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == SCHEDULING_GATE))
}

fn member(name: &str, group: &str, size: u32) -> serde_json::Value {
    let mut p = pod(name, 1, true);
    p["metadata"]["labels"] = json!({"quota.gpuplane.dev/pod-group": group});
    p["metadata"]["annotations"] = json!({"quota.gpuplane.dev/pod-group-size": size.to_string()});
    p
}

/// Binds a released pod to a node, as the scheduler would.
async fn bind(lab: &Lab, name: &str) {
    lab.pods
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"nodeName": "node-1"}})),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn a_four_pod_group_waits_for_four_free_devices_and_is_released_whole_in_one_cycle() {
    let lab = Lab::start(8, Duration::from_secs(3600)).await;
    for i in 0..6 {
        lab.create(pod(&format!("run-{i}"), 1, false)).await;
    }
    for i in 0..4 {
        lab.create(member(&format!("train-{i}"), "train", 4)).await;
    }
    // 6 of 8 used: the group waits, and says why with the numbers. (A cycle that ran while
    // the members were still being created says first that members are missing.)
    eventually_async("the group's members to carry the reason", LIMIT, || async {
        let mut all = true;
        for i in 0..4 {
            let p = lab.pods.get(&format!("train-{i}")).await.unwrap();
            all &=
                condition(&p).is_some_and(|c| c.0 == "False" && c.2.contains("gpus: requested 4,"));
        }
        all
    })
    .await;
    for i in 0..4 {
        let p = lab.pods.get(&format!("train-{i}")).await.unwrap();
        assert!(is_gated(&p));
        let (status, reason, message) = condition(&p).unwrap();
        assert_eq!((status.as_str(), reason.as_str()), ("False", "Waiting"));
        assert!(
            message.contains("gpus: requested 4, used 6 of 8 in GpuQuota team-a/default"),
            "{message}"
        );
        assert!(
            message.contains("pod group team-a/train (4 pods waiting)"),
            "{message}"
        );
    }
    let ev = events_for(&lab.server, "train-0").await;
    assert!(
        ev.iter()
            .any(|e| e.reason.as_deref() == Some("QuotaInsufficient")
                && e.message
                    .as_deref()
                    .is_some_and(|m| m.contains("gpus: requested 4, used 6 of 8"))),
        "{ev:?}"
    );
    let q = lab.quota().await.status.unwrap();
    assert_eq!(q.used.gpus, Gpus::whole(6));
    assert!(q
        .conditions
        .iter()
        .any(|c| c.type_ == "QueueWaiting" && c.status == "True"));

    // One device frees: 3 free, still not enough; nobody of the group moves.
    delete(&lab, "run-0").await;
    lab.cycles(3).await;
    let pods = lab.pods.list(&ListParams::default()).await.unwrap().items;
    let gated: Vec<_> = pods.iter().filter(|p| is_gated(p)).collect();
    assert_eq!(gated.len(), 4, "{:?}", names(&pods));

    // A second one frees: the whole group goes in one cycle.
    lab.server.clear_requests();
    delete(&lab, "run-1").await;
    eventually_async("the group to be released", LIMIT, || async {
        let pods = lab.pods.list(&ListParams::default()).await.unwrap().items;
        // (Mid-cycle, four separate writes may be half done; the request log below shows
        // they belong to one cycle.)
        pods.iter().filter(|p| is_gated(p)).count() == 0
    })
    .await;
    // In the request log, the four gate removals come after one status write and no fresh
    // read of the quotas (a new cycle) falls between them.
    let log = lab.server.requests();
    let gates: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, (m, p))| m == "PATCH" && p.contains("/pods/train-") && !p.contains("/status"))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(gates.len(), 4, "{log:?}");
    let (first, last) = (gates[0], gates[3]);
    assert!(
        !log[first..last]
            .iter()
            .any(|(m, p)| m == "GET" && p.contains("/gpuquotas") && !p.contains("watch")),
        "the group's gates were removed over more than one cycle: {log:?}"
    );
    let status_write = log[..first]
        .iter()
        .rposition(|(m, p)| m == "PUT" && p.contains("/gpuquotas/default/status"));
    assert!(
        status_write.is_some(),
        "admission not recorded before the gates went"
    );
    // The group is accounted for: reserved by the releasing cycle, or already settled into
    // `used` by the next one (the loop may run it before this read).
    let q = lab.quota().await.status.unwrap();
    assert!(
        (q.reserved.gpus == Gpus::whole(4) && q.used.gpus == Gpus::whole(4))
            || (q.reserved.gpus == Gpus::whole(0) && q.used.gpus == Gpus::whole(8)),
        "reserved {:?}, used {:?}",
        q.reserved.gpus,
        q.used.gpus
    );
    // Admitted pods are told so.
    eventually_async("the condition to turn True", LIMIT, || async {
        let p = lab.pods.get("train-3").await.unwrap();
        condition(&p).is_some_and(|c| c.0 == "True" && c.1 == "Admitted")
    })
    .await;
    assert!(lab.metrics.snapshot().released >= 4);
    lab.stop().await;
}

#[tokio::test]
async fn queued_pods_are_released_by_priority_then_creation_time() {
    let lab = Lab::start(2, Duration::from_secs(3600)).await;
    lab.create(pod("run-0", 1, false)).await;
    lab.create(pod("run-1", 1, false)).await;
    // Created with explicit times (the API server's are to the second).
    let mk = |name: &str, prio: i32, created: &str| {
        let mut p = pod(name, 1, true);
        p["spec"]["priority"] = json!(prio);
        p["metadata"]["creationTimestamp"] = json!(created);
        p
    };
    for p in [
        mk("low-old", 0, "2025-01-01T00:00:00Z"),
        mk("high-new", 10, "2025-01-01T00:03:00Z"),
        mk("high-old", 10, "2025-01-01T00:01:00Z"),
        mk("low-new", 0, "2025-01-01T00:04:00Z"),
    ] {
        lab.server.put_json(p).unwrap();
    }
    eventually_async("all four to wait", LIMIT, || async {
        let p = lab.pods.get("low-new").await.unwrap();
        condition(&p).is_some()
    })
    .await;
    let mut order = Vec::new();
    let mut running = vec!["run-0".to_string(), "run-1".to_string()];
    while order.len() < 4 {
        // Free one device; exactly one waiting pod goes, the next in order.
        let done = running.remove(0);
        delete(&lab, &done).await;
        let t = Instant::now();
        let got = loop {
            let pods = lab.pods.list(&ListParams::default()).await.unwrap().items;
            let released: Vec<String> = pods
                .iter()
                .filter(|p| {
                    !is_gated(p) && p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_none()
                })
                .map(|p| p.name_any())
                .filter(|n| !order.contains(n))
                .collect();
            assert!(
                released.len() <= 1,
                "more than one released for one free device: {released:?}"
            );
            if let Some(n) = released.into_iter().next() {
                break Some(n);
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "nothing released after {done} finished"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let name = got.unwrap();
        bind(&lab, &name).await;
        running.push(name.clone());
        order.push(name);
    }
    assert_eq!(order, ["high-old", "high-new", "low-old", "low-new"]);
    lab.stop().await;
}

#[tokio::test]
async fn a_stream_of_small_pods_cannot_keep_a_large_pod_waiting_past_the_bound() {
    let bound = Duration::from_secs(2);
    let lab = Lab::start(4, bound).await;
    let run_time = Duration::from_millis(600);
    let start = Instant::now();
    let mut small = 0;
    let mut started: Vec<(String, Instant)> = Vec::new();
    let mut large_created = None;
    let mut large_released = None;
    let mut small_released_after_large = 0;
    while start.elapsed() < Duration::from_secs(15) && large_released.is_none() {
        // Two small pods arrive every 200 ms: more than the quota can run.
        for _ in 0..2 {
            lab.create(pod(&format!("small-{small}"), 1, true)).await;
            small += 1;
        }
        if large_created.is_none() && start.elapsed() >= Duration::from_millis(500) {
            lab.create(pod("large", 4, true)).await;
            large_created = Some(Instant::now());
        }
        // The scheduler and kubelet: run released pods, finish small ones after run_time.
        let pods = lab.pods.list(&ListParams::default()).await.unwrap().items;
        for p in &pods {
            let name = p.name_any();
            let bound_to_node = p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some();
            if !is_gated(p) && !bound_to_node {
                bind(&lab, &name).await;
                if name == "large" {
                    large_released = Some(Instant::now());
                } else {
                    if large_created.is_some() {
                        small_released_after_large += 1;
                    }
                    started.push((name, Instant::now()));
                }
            }
        }
        let mut i = 0;
        while i < started.len() {
            if started[i].1.elapsed() >= run_time {
                delete(&lab, &started[i].0).await;
                started.remove(i);
            } else {
                i += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let waited = large_released.expect("the large pod starved") - large_created.unwrap();
    eprintln!(
        "large pod waited {waited:?}; {small_released_after_large} small pods backfilled meanwhile"
    );
    // Bound + the run time of what was admitted before it + one cycle and the test's own
    // 200 ms step (and the second-granular creationTimestamp only makes it earlier).
    assert!(
        waited <= bound + run_time + Duration::from_millis(1200),
        "the large pod waited {waited:?}"
    );
    assert!(
        small_released_after_large > 0,
        "small pods never backfilled before the bound: the test proves nothing"
    );
    lab.stop().await;
}

#[tokio::test]
async fn reservations_of_pods_that_never_appeared_are_dropped_and_running_pods_settle_into_used() {
    let lab = Lab::start(8, Duration::from_secs(3600)).await;
    lab.create(pod("runner", 2, false)).await;
    // The webhook reserved for "runner" (now running) and for "ghost" (its create failed),
    // long ago.
    let res = |name: &str| {
        json!({"kind": "Pod", "namespace": QNS, "name": name, "state": "Reserved",
               "charge": {"gpus": "2"}, "since": "2025-01-01T00:00:00Z"})
    };
    let status = json!({"reservations": [res("runner"), res("ghost")], "reserved": {"gpus": "4"}});
    let api: Api<GpuQuota> = Api::namespaced(lab.server.client().unwrap(), QNS);
    // The controller writes this status too: retry on conflict, as any writer must.
    loop {
        let mut q = lab.quota().await;
        q.status = Some(serde_json::from_value(status.clone()).unwrap());
        match api
            .replace_status("default", &PostParams::default(), &q)
            .await
        {
            Ok(_) => break,
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => panic!("{e}"),
        }
    }
    eventually_async("the reservations to go", LIMIT, || async {
        let s = lab.quota().await.status.unwrap_or_default();
        s.reservations.is_empty() && s.used.gpus == Gpus::whole(2)
    })
    .await;
    let s = lab.quota().await.status.unwrap();
    assert_eq!(s.reserved.gpus, Gpus::ZERO);
    lab.stop().await;
}

#[tokio::test]
async fn a_thousand_queued_pods_are_released_in_a_few_cycles_not_one_per_cycle() {
    let lab = Lab::start(100_000, Duration::from_secs(3600)).await;
    let n = 1000;
    for i in 0..n {
        lab.server
            .put_json(pod(&format!("p-{i:05}"), 1, true))
            .unwrap();
    }
    let t = Instant::now();
    eventually_async("every pod to be released", LIMIT, || async {
        lab.metrics.snapshot().released >= n
    })
    .await;
    let took = t.elapsed();
    let m = lab.metrics.snapshot();
    eprintln!(
        "released {n} pods in {took:?} ({:.0}/s); {m:?}",
        n as f64 / took.as_secs_f64()
    );
    // One status write admits as many as the reservation list holds (MAX_RESERVATIONS, 384):
    // three writes for 1000, a few more for stragglers the cache had not seen.
    assert!(m.status_writes <= 8, "{m:?}");
    lab.stop().await;
}
