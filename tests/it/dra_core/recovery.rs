//! What the core recovers at start: a crash mid-prepare, lost or removed specs from the
//! checkpoint, a corrupt checkpoint, a reboot; and the driver libraries scanned once per version.

use super::*;

#[tokio::test]
async fn a_crash_between_started_and_completed_is_recovered() {
    let Some(env) = Env::new() else { return };
    let c = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    let orphan = cref("gone", &uid(2));
    // What a crash of an agent before `cdiSpec` left: PrepareStarted entries and half-made
    // (here: stale) spec files.
    let mut data = CheckpointData::empty("boot-1");
    for r in [&c, &orphan] {
        data.claims.insert(
            r.uid.to_string(),
            ClaimEntry {
                namespace: r.namespace.to_string(),
                name: r.name.to_string(),
                state: ClaimState::PrepareStarted,
                devices: vec![],
                cdi_spec_stem: spec_stem(&r.uid),
                units: BTreeMap::new(),
                cdi_spec: None,
                shares: Vec::new(),
                instances: Vec::new(),
            },
        );
    }
    fs::create_dir_all(env.root.join("state")).unwrap();
    fs::write(env.checkpoint_path(), checkpoint::encode(&data).unwrap()).unwrap();
    fs::create_dir_all(env.cdi()).unwrap();
    for r in [&c, &orphan] {
        fs::write(env.spec_path(&r.uid), b"{\"stale\": true}").unwrap();
    }

    let core = env.core();
    assert_eq!(
        env.checkpoint().claims.len(),
        2,
        "kept until the kubelet retries"
    );
    let out = core.prepare(vec![c.clone()]).await;
    assert_eq!(devices(&out[c.uid.as_str()])[0].device, "gpu-3");
    assert_eq!(
        env.spec(&c.uid).devices.len(),
        1,
        "the stale spec was rewritten"
    );
    assert_eq!(
        env.checkpoint().claims[c.uid.as_str()].state,
        ClaimState::PrepareCompleted
    );

    // Preparing again changes nothing; unprepare then leaves nothing behind, for both.
    assert_eq!(
        core.prepare(vec![c.clone()]).await[c.uid.as_str()],
        out[c.uid.as_str()]
    );
    let out = core.unprepare(vec![c.clone(), orphan.clone()]).await;
    assert!(out.values().all(Result::is_ok), "{out:?}");
    assert_eq!(fs::read_dir(env.cdi()).unwrap().count(), 0);
    assert!(env.checkpoint().claims.is_empty());
}

#[tokio::test]
async fn specs_lost_or_left_empty_are_restored_from_the_checkpoint_at_start() {
    let Some(env) = Env::new() else { return };
    let a = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    let b = env.add_claim("b", &uid(2), &[("gpu", &env.mig(0))], json!([]));
    let core = env.core();
    let first = core.prepare(vec![a.clone(), b.clone()]).await;
    assert!(first.values().all(Result::is_ok), "{first:?}");
    let (spec_a, spec_b) = (
        fs::read(env.spec_path(&a.uid)).unwrap(),
        fs::read(env.spec_path(&b.uid)).unwrap(),
    );
    drop(core);
    // The spec files are written without fsync: a power loss can leave one empty, or take it.
    fs::write(env.spec_path(&a.uid), b"").unwrap();
    fs::remove_file(env.spec_path(&b.uid)).unwrap();
    let core = env.core();
    assert_eq!(fs::read(env.spec_path(&a.uid)).unwrap(), spec_a);
    assert_eq!(fs::read(env.spec_path(&b.uid)).unwrap(), spec_b);
    let before = mtimes(&env.cdi());
    assert_eq!(core.prepare(vec![a.clone(), b.clone()]).await, first);
    assert_eq!(mtimes(&env.cdi()), before, "answered from the checkpoint");
}

#[tokio::test]
async fn a_spec_removed_behind_our_back_is_written_again() {
    let Some(env) = Env::new() else { return };
    let core = env.core();
    let c = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    let first = core.prepare(vec![c.clone()]).await;
    fs::remove_file(env.spec_path(&c.uid)).unwrap();
    assert_eq!(core.prepare(vec![c.clone()]).await, first);
    assert!(env.spec_path(&c.uid).exists());
}

#[tokio::test]
async fn a_corrupt_checkpoint_is_set_aside_and_the_core_starts_empty() {
    let Some(env) = Env::new() else { return };
    let c = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    env.core().prepare(vec![c.clone()]).await[c.uid.as_str()]
        .as_ref()
        .unwrap();
    let mut bytes = fs::read(env.checkpoint_path()).unwrap();
    let last = bytes.len() - 2;
    bytes[last] ^= 0x20;
    fs::write(env.checkpoint_path(), &bytes).unwrap();

    let core = env.core();
    assert!(core.checkpoint().await.claims.is_empty());
    let aside: Vec<String> = fs::read_dir(env.root.join("state"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("dra-checkpoint.json.corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1);
    assert_eq!(
        fs::read(env.root.join("state").join(&aside[0])).unwrap(),
        bytes
    );
    assert!(
        env.checkpoint().claims.is_empty(),
        "a fresh, valid checkpoint replaced it"
    );
    // The claim's spec outlived its entry; unprepare still removes it.
    assert!(env.spec_path(&c.uid).exists());
    assert!(core.unprepare(vec![c.clone()]).await[c.uid.as_str()].is_ok());
    assert!(!env.spec_path(&c.uid).exists());
}

#[tokio::test]
async fn a_reboot_invalidates_prepared_claims_and_removes_their_specs() {
    let Some(env) = Env::new() else { return };
    let c = env.add_claim("a", &uid(1), &[("gpu", "gpu-3")], json!([]));
    env.core().prepare(vec![c.clone()]).await[c.uid.as_str()]
        .as_ref()
        .unwrap();
    assert!(env.spec_path(&c.uid).exists());
    // A claim spec no entry names (an unsynced removal a power loss undid), and another file.
    let orphan = env.spec_path(&uid(9));
    fs::copy(env.spec_path(&c.uid), &orphan).unwrap();
    let other = env.cdi().join("vendor-spec.json");
    fs::write(&other, b"{}").unwrap();
    fs::write(env.root.join("proc/sys/kernel/random/boot_id"), "boot-2\n").unwrap();
    let core = env.core();
    assert!(!env.spec_path(&c.uid).exists());
    assert!(
        !orphan.exists(),
        "every claim spec of the earlier boot is swept"
    );
    assert!(other.exists(), "only claim specs");
    let cp = env.checkpoint();
    assert!(cp.claims.is_empty());
    assert_eq!(cp.boot_id, "boot-2");
    // The kubelet prepares it again after the reboot.
    assert!(core.prepare(vec![c.clone()]).await[c.uid.as_str()].is_ok());
    assert!(env.spec_path(&c.uid).exists());
}

/// Host paths of every mount a spec makes (spec-wide and per device).
fn mounted(spec: &Spec) -> Vec<String> {
    spec.container_edits
        .mounts
        .iter()
        .chain(spec.devices.iter().flat_map(|d| &d.container_edits.mounts))
        .map(|m| m.host_path.clone())
        .collect()
}

/// The driver's libraries are scanned once per driver version, not per prepare: a library
/// installed after the first prepare is not in the second claim's spec (no scan saw it), and a
/// new driver version (an upgrade the inventory reports) scans again. Device nodes are still
/// checked on every prepare (see `missing_device_nodes_fail_the_prepare_until_they_appear`).
#[tokio::test]
async fn driver_libraries_are_scanned_once_per_driver_version() {
    let Some(env) = Env::new() else { return };
    let lib = env.root.join("driver/usr/lib64");
    fs::create_dir_all(&lib).unwrap();
    let version = env.inv.driver_version.clone();
    let cuda = lib.join(format!("libcuda.so.{version}"));
    let nvml = lib.join(format!("libnvidia-ml.so.{version}"));
    fs::write(&cuda, b"").unwrap();
    let core = env.core();
    let prepare = |name: &str, n: u8, device: String| {
        let c = env.add_claim(name, &uid(n), &[("gpu", &device)], json!([]));
        let core = &core;
        async move {
            let out = core.prepare(vec![c.clone()]).await;
            assert!(out[c.uid.as_str()].is_ok(), "{:?}", out[c.uid.as_str()]);
            c.uid
        }
    };
    let has =
        |uid: &str, file: &Path| mounted(&env.spec(uid)).contains(&file.display().to_string());

    let first = prepare("a", 1, env.mig(0)).await;
    assert!(has(&first, &cuda));
    fs::write(&nvml, b"").unwrap();
    let second = prepare("b", 2, env.mig(1)).await;
    assert!(has(&second, &cuda));
    assert!(!has(&second, &nvml), "the second prepare scanned again");
    assert_eq!(core.install_scans(), 1);

    let upgraded = "999.10.1";
    let new_cuda = lib.join(format!("libcuda.so.{upgraded}"));
    fs::write(&new_cuda, b"").unwrap();
    env.state.update(|s| {
        let mut inv = s.inventory.clone();
        inv.driver_version = upgraded.into();
        let config = s.config.clone();
        s.replace_inventory(inv, config).unwrap();
        ((), true)
    });
    let third = prepare("c", 3, env.mig(2)).await;
    assert!(has(&third, &new_cuda), "{:?}", mounted(&env.spec(&third)));
    assert!(
        has(&third, &nvml),
        "the new version's scan sees every library"
    );
    assert_eq!(core.install_scans(), 2);
}
