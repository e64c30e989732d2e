//! podman runs containers with what Allocate gives and with a claim prepared on a simulated
//! node (a fake driver root and /proc).

use super::*;

/// The `env` of a container of `image` started with CDI `devices` and `env`, as lines.
fn container_env(devices: &[&str], env: &[String], image: &str) -> Vec<String> {
    let out = ok(&mut podman(&run_args_env(devices, env, image, "env")));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// `key=value` lines of `env` output, as a set of lines.
fn has_line(env: &[String], line: &str) -> bool {
    env.iter().any(|l| l == line)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_runs_a_container_with_what_allocate_gives_on_a_simulated_node() {
    if lacks_prerequisites() {
        return;
    }
    let id = unique_id();
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    // A simulated machine of two GPUs; no device nodes, no driver files anywhere.
    let mut inv = gpuplane_model::sim::load("pcie-l4x4").unwrap();
    inv.gpus.truncate(2);
    inv.topology.links.retain(|l| l.from < 2 && l.to < 2);
    let kubelet = KubeletDouble::start(&d.join("kubelet")).await.unwrap();
    let opts = NodeOptions {
        node_name: NODE.into(),
        paths: HostPaths {
            kubelet_root: d.join("kubelet"),
            cdi_root: d.join("cdi"),
            state_dir: d.join("state"),
            driver_root: d.join("driver"),
            driver_root_mount: None,
            dev_root: d.join("dev"),
            ..HostPaths::standard()
        },
        config_file: None,
        sharing_switch: None,
        device_plugin: true,
        dra: None,
        api: None,
        metrics_addr: None,
        device_mode: DeviceMode::Simulated,
        telemetry: None,
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let source: Arc<dyn DeviceSource> = Arc::new(SimSource::new(inv.clone()));
    let task = tokio::spawn(gpuplane_node::node::run(opts, source, async {
        let _ = stopped.await;
    }));
    let agent = Agent { stop, task };
    let view = kubelet
        .wait_for(WAIT, |p| {
            p.get("nvidia.com/gpu")
                .is_some_and(|v| v.devices.len() == 2)
        })
        .await
        .unwrap()["nvidia.com/gpu"]
        .clone();
    let ids: Vec<String> = view.devices.iter().map(|d| d.id.clone()).collect();
    let grant = kubelet.allocate("nvidia.com/gpu", &ids).await.unwrap();
    let uuids = [inv.gpus[0].uuid.as_str(), inv.gpus[1].uuid.as_str()];

    // The node spec the agent wrote, into /var/run/cdi under a kind of this run's.
    let written = d.join("cdi").join(format!(
        "{}.json",
        gpuplane_node::cdi::node_spec::NODE_SPEC_STEM
    ));
    let mut spec: cdi::Spec = serde_json::from_slice(&fs::read(&written).unwrap()).unwrap();
    assert_eq!(spec.kind, "nvidia.com/gpu");
    assert_eq!(spec.cdi_version, "0.5.0", "podman 4.3 reads at most 0.5.0");
    let kind = format!("test-{id}.gpuplane.dev/gpu");
    spec.kind = kind.clone();
    let stem = format!("gpuplane-test-{id}");
    let mut cleanup = Cleanup {
        stems: vec![stem.clone()],
        image: None,
    };
    cdi::write_spec(Path::new(CDI_ROOT), &stem, &spec, cdi::Durability::Durable).unwrap();
    let image = busybox_image(d, &id, &mut cleanup);

    let devices: Vec<String> = grant
        .cdi_devices
        .iter()
        .map(|c| {
            let name = c
                .name
                .strip_prefix("nvidia.com/gpu=")
                .unwrap_or_else(|| panic!("{} is not a node spec name", c.name));
            format!("{kind}={name}")
        })
        .collect();
    assert_eq!(devices.len(), 2, "{:?}", grant.cdi_devices);
    let env: Vec<String> = grant.envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let device_refs: Vec<&str> = devices.iter().map(String::as_str).collect();
    let seen = container_env(&device_refs, &env, &image);
    let visible = format!("NVIDIA_VISIBLE_DEVICES={}", uuids.join(","));
    assert!(has_line(&seen, &visible), "{seen:#?}");
    for (i, uuid) in uuids.iter().enumerate() {
        let line = format!("GPUPLANE_DEVICE_{i}=index={i},uuid={uuid},profile=");
        assert!(has_line(&seen, &line), "{line} not in {seen:#?}");
    }
    assert!(!has_line(&seen, "NVIDIA_VISIBLE_DEVICES=void"), "{seen:#?}");

    agent.stop().await;
    drop(cleanup);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn podman_runs_a_container_with_a_claim_prepared_on_a_simulated_node() {
    if lacks_prerequisites() {
        return;
    }
    let id = unique_id();
    let driver = format!("t{id}.gpuplane.dev");
    let lab = Lab::new("a100-mig-mixed").await;
    let inv = lab.sim.discover().unwrap().inventory;
    let dra_devices = inv.dra_devices();
    let whole = *dra_devices
        .iter()
        .find(|d| matches!(d, gpuplane_model::inventory::DeviceRef::Gpu(_)))
        .expect("a whole GPU");
    let part = *dra_devices
        .iter()
        .find(|d| matches!(d, gpuplane_model::inventory::DeviceRef::Mig { .. }))
        .expect("a MIG device");
    let (parent, mig) = match part {
        gpuplane_model::inventory::DeviceRef::Mig { parent, mig } => (parent, mig),
        gpuplane_model::inventory::DeviceRef::Gpu(_) => unreachable!("found as MIG"),
    };
    let mig_index = parent
        .mig_devices
        .iter()
        .position(|m| m.uuid == mig.uuid)
        .unwrap();

    let cdi_root = lab.dir.path().join("cdi-sim");
    let nowhere = lab.dir.path().join("no-such-dir");
    let host = Host {
        cdi_root: &cdi_root,
        dev_root: &nowhere,
        driver_root: &nowhere,
        proc_root: None,
        config: "",
    };
    let agent = Agent::start(&lab, &driver, host, DeviceMode::Simulated);
    lab.dra.wait_registered(&driver, WAIT).await.unwrap();
    let obj = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "sim", "namespace": "team-a"},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": driver, "count": 1}},
            {"name": "part", "exactly": {"deviceClassName": driver, "count": 1}}]}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": driver, "pool": NODE, "device": whole.dra_name()},
            {"request": "part", "driver": driver, "pool": NODE, "device": part.dra_name()}]}}}
    });
    let stored = lab.api.put_json(obj).unwrap();
    let claim =
        ClaimRef::parse("team-a", stored["metadata"]["uid"].as_str().unwrap(), "sim").unwrap();
    let devices = prepare_claim(&lab, &driver, &claim).await;
    let ids: Vec<String> = devices
        .iter()
        .flat_map(|d| d.cdi_ids.iter().cloned())
        .collect();
    let kind = format!("k8s.{driver}/claim");
    assert_eq!(
        ids,
        [
            format!("{kind}={}-{}", claim.uid, whole.dra_name()),
            format!("{kind}={}-{}", claim.uid, part.dra_name())
        ]
    );

    // The claim's spec as the agent wrote it, where podman reads specs.
    let stem = format!("gpuplane-claim-{}", claim.uid);
    let mut cleanup = Cleanup {
        stems: vec![stem.clone()],
        image: None,
    };
    let written = cdi_root.join(format!("{stem}.json"));
    fs::create_dir_all(CDI_ROOT).unwrap();
    fs::copy(&written, spec_file(&stem)).unwrap();
    let image = busybox_image(lab.dir.path(), &id, &mut cleanup);

    let whole_line = format!(
        "GPUPLANE_DEVICE_{i}=index={i},uuid={},profile=",
        whole.uuid(),
        i = whole.gpu().index
    );
    let part_line = format!(
        "GPUPLANE_DEVICE_{p}_MIG_{mig_index}=index={p}:{mig_index},uuid={},profile={}",
        mig.uuid,
        mig.profile,
        p = parent.index
    );
    let visible = format!("NVIDIA_VISIBLE_DEVICES={},{}", whole.uuid(), mig.uuid);
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let seen = container_env(&refs, &[], &image);
    for line in [&whole_line, &part_line, &visible] {
        assert!(has_line(&seen, line), "{line} not in {seen:#?}");
    }
    // Only the MIG request: its own identity; NVIDIA_VISIBLE_DEVICES is the claim's (the
    // documented limit of a spec-level value).
    let seen = container_env(&refs[1..], &[], &image);
    assert!(has_line(&seen, &part_line), "{seen:#?}");
    assert!(!has_line(&seen, &whole_line), "{seen:#?}");
    assert!(has_line(&seen, &visible), "{seen:#?}");

    unprepare_claim(&lab, &driver, &claim).await;
    assert!(!written.exists(), "unprepare left the claim's spec");
    agent.stop().await;
    drop(cleanup);
}
