//! Prepare and unprepare through the core: idempotent per claim, errors naming the claim, device
//! nodes that must exist, simulated devices, configs as container environment, concurrency.

use super::*;

#[tokio::test]
async fn prepares_each_claim_on_its_own_idempotently_and_unprepares() {
    let Some(env) = Env::new() else { return };
    let core = env.core();
    let mig = env.mig(0);
    let a = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    let b = env.add_claim("b", &uid(2), &[("gpu", &mig)], json!([]));
    let bad = env.add_claim("bad", &uid(3), &[("gpu", "gpu-0")], json!([]));

    let first = core.prepare(vec![a.clone(), b.clone(), bad.clone()]).await;
    assert_eq!(first.len(), 3);
    let da = devices(&first[a.uid.as_str()]);
    assert_eq!(
        da,
        &[PreparedDevice {
            requests: vec!["gpu".into()],
            pool: NODE.into(),
            device: "gpu-3".into(),
            cdi_ids: vec![format!("{KIND}={}-gpu-3", a.uid)],
            share_id: None,
        }]
    );
    assert_eq!(
        devices(&first[b.uid.as_str()])[0].cdi_ids,
        vec![format!("{KIND}={}-{mig}", b.uid)]
    );
    let err = first[bad.uid.as_str()].as_ref().unwrap_err();
    assert!(
        err.contains("ns/bad") && err.contains("gpu-0") && err.contains(bad.uid.as_str()),
        "{err}"
    );

    // The specs: one per claim, our kind, the claim's device with its nodes.
    let spec = env.spec(&a.uid);
    assert_eq!(spec.kind, KIND);
    assert_eq!(
        spec.cdi_version, "0.5.0",
        "a name starting with a digit; podman 4.3 reads it"
    );
    assert_eq!(spec.devices.len(), 1);
    assert_eq!(spec.devices[0].name, format!("{}-gpu-3", a.uid));
    let gpu3 = env.inv.gpu(3).unwrap();
    let node_paths: Vec<&str> = spec.devices[0]
        .container_edits
        .device_nodes
        .iter()
        .map(|n| n.path.as_str())
        .collect();
    assert_eq!(node_paths, vec![format!("/dev/nvidia{}", gpu3.minor)]);
    let mig_nodes = &env.spec(&b.uid).devices[0].container_edits.device_nodes;
    assert_eq!(
        mig_nodes.len(),
        3,
        "GPU node and the GI and CI access nodes: {mig_nodes:?}"
    );
    assert!(!env.spec_path(&bad.uid).exists());

    let cp = env.checkpoint();
    assert_eq!(cp.claims.len(), 2);
    assert_eq!(
        cp.claims[a.uid.as_str()].state,
        ClaimState::PrepareCompleted
    );
    assert_eq!(cp.claims[a.uid.as_str()].devices, da);
    let units = core.prepared_units().await;
    assert_eq!(units.get(gpu3.uuid.as_str()), Some(&a.uid.to_string()));
    assert_eq!(units.len(), 2);

    // Again: the same answer, nothing rewritten.
    let before = mtimes(&env.cdi());
    let cp_before = fs::read(env.checkpoint_path()).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let second = core.prepare(vec![a.clone(), b.clone(), bad.clone()]).await;
    assert_eq!(second[a.uid.as_str()], first[a.uid.as_str()]);
    assert_eq!(second[b.uid.as_str()], first[b.uid.as_str()]);
    assert!(second[bad.uid.as_str()].is_err());
    assert_eq!(mtimes(&env.cdi()), before);
    assert_eq!(fs::read(env.checkpoint_path()).unwrap(), cp_before);

    // A new core (agent restart) answers the same from the checkpoint, without the API.
    env.claims.remove("ns", "a");
    let restarted = env.core();
    assert_eq!(
        restarted.prepare(vec![a.clone()]).await[a.uid.as_str()],
        first[a.uid.as_str()]
    );
    assert_eq!(mtimes(&env.cdi()), before);

    let out = restarted
        .unprepare(vec![a.clone(), b.clone(), cref("never", &uid(9))])
        .await;
    assert!(out.values().all(Result::is_ok), "{out:?}");
    assert!(!env.spec_path(&a.uid).exists() && !env.spec_path(&b.uid).exists());
    assert!(env.checkpoint().claims.is_empty());
    assert!(restarted.prepared_units().await.is_empty());
    assert_eq!(fs::read_dir(env.cdi()).unwrap().count(), 0);
    // Unpreparing again is fine. (A UID that is not one never reaches the core: the gRPC edge
    // answers its unprepare with success, tests/it/security.rs.)
    let out = restarted.unprepare(vec![a.clone()]).await;
    assert!(out.values().all(Result::is_ok), "{out:?}");
}

#[tokio::test]
async fn per_claim_errors_name_the_claim_and_the_reason() {
    let Some(env) = Env::new() else { return };
    let core = env.core();
    let mut cases: Vec<(ClaimRef, &str)> = Vec::new();

    let wrong = env.add_claim("recreated", &uid(1), &[("gpu", "gpu-3")], json!([]));
    cases.push((cref("recreated", &uid(2)), "not 0b5c3f2e"));
    let _ = wrong;

    let c = env.add_claim("elsewhere", &uid(3), &[("gpu", "gpu-3")], json!([]));
    let mut claim = env.claims.get("ns", "elsewhere").await.unwrap();
    let results = claim
        .status
        .as_mut()
        .unwrap()
        .allocation
        .as_mut()
        .unwrap()
        .devices
        .as_mut()
        .unwrap();
    results.results.as_mut().unwrap()[0].pool = "node-b".into();
    env.claims.insert(claim);
    cases.push((c, "pool node-b"));

    cases.push((
        cref("missing", &uid(4)),
        "ResourceClaim ns/missing not found",
    ));

    let bad_config = json!([{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.gpuplane.dev/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "Turbo"}}}}]);
    let c = env.add_claim("badconfig", &uid(5), &[("gpu", "gpu-3")], bad_config);
    cases.push((c, "sharing.strategy: `Turbo`"));

    // A UID or namespace that could reach a path never reaches the core: the gRPC edge parses
    // claims into ClaimRef, which refuses them (tests/it/security.rs sends them over the socket).
    let evil = ClaimRef::parse("ns", "../../x", "evil").unwrap_err();
    assert!(evil.to_string().contains("claim UID `../../x`"), "{evil}");
    let evil = ClaimRef::parse("a/b", uid(6), "x").unwrap_err();
    assert!(evil.to_string().contains("namespace `a/b`"), "{evil}");

    let mig = env.mig(1);
    let c = env.add_claim("sick", &uid(7), &[("gpu", &mig)], json!([]));
    let (parent_uuid, mig_uuid) = match env.inv.dra_device(&mig).unwrap() {
        DeviceRef::Mig { parent, mig } => (parent.uuid.clone(), mig.uuid.clone()),
        DeviceRef::Gpu(_) => unreachable!(),
    };
    let changes = core.health_changes();
    env.state.update(|s| {
        let policy = s.config.xid_policy.clone();
        s.health.on_event(
            &gpuplane_model::source::DeviceEvent::Xid {
                gpu_uuid: parent_uuid,
                mig_uuid: Some(mig_uuid.clone()),
                xid: 48,
            },
            Instant::now(),
            &policy,
        );
        ((), true)
    });
    assert!(changes.has_changed().unwrap());
    cases.push((c, "critical Xid 48"));

    let ok = env.add_claim("fine", &uid(8), &[("gpu", "gpu-3")], json!([]));
    let claims: Vec<ClaimRef> = cases
        .iter()
        .map(|(c, _)| c.clone())
        .chain([ok.clone()])
        .collect();
    let out = core.prepare(claims).await;
    for (c, want) in &cases {
        let err = out[c.uid.as_str()].as_ref().unwrap_err();
        assert!(
            err.contains(&format!("claim {}/{}", c.namespace, c.name)) && err.contains(want),
            "{err}\nwant {want}"
        );
    }
    assert!(out[ok.uid.as_str()].is_ok());
    assert_eq!(
        fs::read_dir(env.cdi()).unwrap().count(),
        1,
        "only the good claim has a spec"
    );
    assert_eq!(env.checkpoint().claims.len(), 1);

    let report = core.device_health();
    assert_eq!(report.len(), env.inv.dra_devices().len());
    let sick = report.iter().find(|r| r.device == mig).unwrap();
    assert_eq!(
        (sick.health, sick.message.as_str(), sick.pool.as_str()),
        (DeviceHealthState::Unhealthy, "critical Xid 48", NODE)
    );
    assert_eq!(
        report
            .iter()
            .filter(|r| r.health == DeviceHealthState::Healthy)
            .count(),
        report.len() - 1
    );
}

#[tokio::test]
async fn missing_device_nodes_fail_the_prepare_until_they_appear() {
    let Some(env) = Env::new() else { return };
    let core = env.core();
    let c = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    let node = env
        .root
        .join(format!("dev/nvidia{}", env.inv.gpu(3).unwrap().minor));
    fs::remove_file(&node).unwrap();
    let prepare_error = || async {
        core.prepare(vec![c.clone()])
            .await
            .remove(c.uid.as_str())
            .unwrap()
            .unwrap_err()
    };
    let err = prepare_error().await;
    assert!(
        err.contains(&format!("{} does not exist yet", node.display())),
        "{err}"
    );
    // Another claim's devices do not care.
    let mig = env.mig(0);
    let other = env.add_claim("b", &uid(2), &[("gpu", &mig)], json!([]));
    assert!(core.prepare(vec![other.clone()]).await[other.uid.as_str()].is_ok());
    // A regular file or another GPU's number in its place is no better.
    fs::write(&node, b"").unwrap();
    let err = prepare_error().await;
    assert!(
        err.contains(&format!(
            "{} is a regular file, not a character device",
            node.display()
        )),
        "{err}"
    );
    devnodes::make_node(&node, 195, 9).unwrap();
    let err = prepare_error().await;
    assert!(
        err.contains(&format!(
            "{} has device number 195:9, expected 195:3",
            node.display()
        )),
        "{err}"
    );
    assert!(!env.spec_path(&c.uid).exists(), "no spec names a bad node");
    devnodes::make_node(&node, 195, 3).unwrap();
    assert!(core.prepare(vec![c.clone()]).await[c.uid.as_str()].is_ok());
}

#[tokio::test]
async fn simulated_devices_are_prepared_without_device_nodes_and_carry_their_identity() {
    let env = Env::simulated();
    let core = env.core();
    let mig = env.mig(1);
    let c = env.add_claim(
        "a",
        &uid(1),
        &[("gpu", "gpu-3"), ("part", &mig)],
        json!([{"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.gpuplane.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing"}}}}]),
    );
    let prepared = core
        .prepare(vec![c.clone()])
        .await
        .remove(c.uid.as_str())
        .unwrap();
    assert_eq!(prepared.unwrap().len(), 2);
    let spec = env.spec(&c.uid);
    let gpu3 = env.inv.gpu(3).unwrap();
    let (parent, part) = env
        .inv
        .gpus
        .iter()
        .find_map(|g| {
            let i = g.mig_devices.iter().position(|m| {
                gpuplane_model::inventory::DeviceRef::Mig { parent: g, mig: m }.dra_name() == mig
            })?;
            Some((g, i))
        })
        .unwrap();
    let m = &parent.mig_devices[part];
    assert_eq!(
        spec.container_edits.env,
        vec![format!("NVIDIA_VISIBLE_DEVICES={},{}", gpu3.uuid, m.uuid)]
    );
    let env_of = |suffix: &str| {
        spec.devices
            .iter()
            .find(|d| d.name == format!("{}-{suffix}", c.uid))
            .unwrap()
            .container_edits
            .clone()
    };
    let whole = env_of("gpu-3");
    // The identity first, then the config's environment.
    assert_eq!(
        whole.env[0],
        format!("GPUPLANE_DEVICE_3=index=3,uuid={},profile=", gpu3.uuid)
    );
    assert!(
        whole.env[1..].contains(&"GPUPLANE_SHARING_STRATEGY=TimeSlicing".to_string()),
        "{:?}",
        whole.env
    );
    let sliced = env_of(&mig);
    assert_eq!(
        sliced.env,
        vec![format!(
            "GPUPLANE_DEVICE_{p}_MIG_{part}=index={p}:{part},uuid={},profile={}",
            m.uuid,
            m.profile,
            p = parent.index
        )]
    );
    for e in [&whole, &sliced, &spec.container_edits] {
        assert!(e.device_nodes.is_empty() && e.mounts.is_empty() && e.hooks.is_empty());
    }
    assert_eq!(spec.cdi_version, "0.5.0");
}

/// A config becomes environment only where the node carries it out; an MPS config or a
/// time-slice interval it would not apply is refused at prepare, naming the field, with
/// nothing written and nothing held.
#[tokio::test]
async fn configs_become_container_environment_or_are_refused_naming_what_is_not_done() {
    let Some(env) = Env::new() else { return };
    let core = env.core();
    let (mig, other) = (env.mig(2), env.mig(5));
    let gpu_config = |sharing: serde_json::Value| {
        json!({"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.gpuplane.dev/v1alpha1", "kind": "GpuConfig", "sharing": sharing}})
    };
    let config = json!([
        {"source": "FromClass", "opaque": gpu_config(json!({"strategy": "TimeSlicing"}))},
        {"source": "FromClaim", "opaque": {"driver": "other.example.com", "parameters": {"anything": true}}}
    ]);
    let c = env.add_claim(
        "a",
        &uid(1),
        &[("whole", "gpu-3"), ("shared", &mig)],
        config,
    );
    let out = core.prepare(vec![c.clone()]).await;
    assert_eq!(devices(&out[c.uid.as_str()]).len(), 2, "{out:?}");
    let spec = env.spec(&c.uid);
    for device in ["gpu-3", mig.as_str()] {
        let edits = &spec
            .devices
            .iter()
            .find(|d| d.name == format!("{}-{device}", c.uid))
            .unwrap()
            .container_edits;
        assert_eq!(edits.env, ["GPUPLANE_SHARING_STRATEGY=TimeSlicing"]);
    }
    assert!(spec
        .container_edits
        .env
        .contains(&"NVIDIA_VISIBLE_DEVICES=void".to_string()));

    let refused = [
        (
            json!({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}),
            "sharing.strategy: MPS is not supported",
        ),
        (
            json!({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
            "sharing.timeSlicingConfig.interval: Long is not supported",
        ),
    ];
    for (i, (sharing, why)) in refused.into_iter().enumerate() {
        let c = env.add_claim(
            "a",
            &uid(2 + i as u8),
            &[("gpu", other.as_str())],
            json!([{"source": "FromClaim", "opaque": gpu_config(sharing)}]),
        );
        let err = core.prepare(vec![c.clone()]).await[c.uid.as_str()]
            .clone()
            .unwrap_err();
        assert!(err.contains(why), "{err}");
        assert!(
            !env.spec_path(&c.uid).exists(),
            "a refused claim has a spec"
        );
    }
    let free = env.add_claim("a", &uid(9), &[("gpu", other.as_str())], json!([]));
    assert!(
        core.prepare(vec![free.clone()]).await[free.uid.as_str()].is_ok(),
        "a refused claim left {other} held"
    );
}

#[tokio::test]
async fn concurrent_prepares_of_one_claim_agree() {
    let Some(env) = Env::new() else { return };
    let core = Arc::new(env.core());
    let c = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    let (x, y) = tokio::join!(core.prepare(vec![c.clone()]), core.prepare(vec![c.clone()]));
    assert_eq!(x, y);
    assert!(x[c.uid.as_str()].is_ok());
    assert_eq!(
        env.checkpoint().claims[c.uid.as_str()].state,
        ClaimState::PrepareCompleted
    );
}
