//! Crash consistency of shares (fractional GPUs through DRA consumable capacity): the real agent
//! binary, with the stand-in `nvidia-cuda-mps-control` (hack/fake-mps) in its driver root, is
//! killed with SIGKILL at every step of a share's life, the MPS control daemon's start and stop
//! included, restarted, and checked from the outside (tests/it/crash.rs does the same for whole
//! devices; the node is tests/support/crash_node.rs).
//!
//! Two claims, each a 40Gi/50% share of GPU 0 of a dgx-a100 (80Gi GPUs). Each case kills the
//! agent in the first or the second share's prepare (or unprepare), restarts it, and checks:
//! the checkpoint still records the crashed claim exactly when the step had written it; while a
//! share is recorded exactly one live daemon serves the GPU, the one that ran before the kill
//! (adopted, not restarted), and the ledger holds exactly the recorded shares (ListAndWatch
//! withdraws the GPU, Allocate of it is refused, a share asking the whole GPU is refused naming
//! exactly those holders); with none recorded, no daemon runs and the GPU is offered. Then a
//! retried prepare answers the allocated device and share, with the MPS limits in the claim's
//! CDI spec, and once every share is unprepared no daemon runs for the GPU, its directory under
//! `<state>/mps` is gone and the whole GPU is offered and prepared again.

#![cfg(feature = "crashpoints")]

use crate::support;

use crate::crash_node::{cdi_ids, Node, GPU_RESOURCE, WAIT};
use crate::support::{DRIVER, NODE};
use gpuplane_node::dra::{ClaimRef, PreparedDevice};
use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};

const PROFILE: &str = "dgx-a100";
const SHARING: &str =
    "sharing:\n  consumableCapacity:\n    gpus: all\n    memoryStep: 1Gi\n    computeStep: 10\n";
/// The shared GPU (index and DRA device name).
const GPU: usize = 0;
const DEVICE: &str = "gpu-0";
/// What each share consumes: half of an 80Gi GPU.
const MEMORY: &str = "40Gi";
const COMPUTE: &str = "50";
/// The stand-in's hidden argument for its serving process (hack/fake-mps/src/main.rs): the
/// daemon that `-d` leaves running.
const SERVE: &str = "--serve";

/// A crash node with the sharing config and the stand-in MPS control program in its driver
/// root. Dropping it kills the agent, then every stand-in daemon serving a pipe directory under
/// the node's directory, so none outlives the test, whatever it left behind.
struct SharesNode {
    node: Node,
    probes: Cell<usize>,
}

impl Deref for SharesNode {
    type Target = Node;
    fn deref(&self) -> &Node {
        &self.node
    }
}

impl DerefMut for SharesNode {
    fn deref_mut(&mut self) -> &mut Node {
        &mut self.node
    }
}

impl Drop for SharesNode {
    fn drop(&mut self) {
        drop(self.node.agent.take());
        for pid in daemons(|pipe| pipe.starts_with(self.node.dir.path())) {
            // Best effort: a daemon that ended meanwhile is fine too.
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
    }
}

/// The live stand-in daemons whose pipe directory `pipe` accepts: processes serving (`SERVE`)
/// with `CUDA_MPS_PIPE_DIRECTORY` in their environment. A zombie (dead, not yet reaped by
/// whoever inherited the orphan) is not live; a process that ends while it is read is skipped.
fn daemons(pipe: impl Fn(&Path) -> bool) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let read = |f: &str| std::fs::read(format!("/proc/{pid}/{f}")).unwrap_or_default();
        let serving = read("cmdline")
            .split(|b| *b == 0)
            .any(|a| a == SERVE.as_bytes());
        let environ = read("environ");
        let dir = environ
            .split(|b| *b == 0)
            .find_map(|v| v.strip_prefix(b"CUDA_MPS_PIPE_DIRECTORY="))
            .map(|d| PathBuf::from(String::from_utf8_lossy(d).into_owned()));
        if serving && dir.is_some_and(|d| pipe(&d)) && alive(pid) {
            out.push(pid);
        }
    }
    out
}

/// Whether `pid` runs: it exists and is no zombie (`/proc/<pid>/stat` state after the last `)`).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')').is_some_and(|(_, r)| {
            let r = r.trim_start();
            !r.starts_with('Z') && !r.starts_with('X')
        })
    })
}

impl SharesNode {
    async fn new() -> SharesNode {
        let node = Node::new(PROFILE, SHARING).await;
        let bin = node.path("driver/usr/bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::os::unix::fs::symlink(
            support::built_fake_mps(),
            bin.join("nvidia-cuda-mps-control"),
        )
        .unwrap();
        SharesNode {
            node,
            probes: Cell::new(0),
        }
    }

    fn uuid(&self) -> &str {
        &self.uuids[GPU]
    }

    /// `<state>/mps/<uuid>`: the daemon's pipe and log directories.
    fn mps_dir(&self) -> PathBuf {
        self.path(&format!("state/mps/{}", self.uuid()))
    }

    fn pipe(&self) -> PathBuf {
        self.mps_dir().join("pipe")
    }

    /// Claim `name` allocated by the (absent) scheduler a share of the GPU under `share_id`.
    fn share_claim(&self, name: &str, share_id: &str, memory: &str, compute: &str) -> ClaimRef {
        let stored = self
            .api
            .put_json(serde_json::json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": "team-a"},
                "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                    "deviceClassName": "gpu.gpuplane.dev", "count": 1,
                    "capacity": {"requests": {"memory": memory, "compute": compute}}}}]}},
                "status": {"allocation": {"devices": {"results": [{
                    "request": "gpus", "driver": DRIVER, "pool": NODE, "device": DEVICE,
                    "shareID": share_id,
                    "consumedCapacity": {"memory": memory, "compute": compute}}]}}}
            }))
            .unwrap();
        ClaimRef::parse("team-a", stored["metadata"]["uid"].as_str().unwrap(), name).unwrap()
    }

    /// What NodePrepareResources answered for `c`, or the claim's error.
    async fn prepare_share(&self, c: &ClaimRef) -> Result<Vec<PreparedDevice>, String> {
        let mut out = self
            .dra
            .prepare(DRIVER, std::slice::from_ref(c))
            .await
            .map_err(|s| s.message().to_string())?;
        out.remove(c.uid.as_str()).unwrap()
    }

    /// Prepares share `s` and checks the answer (the allocated device, share and CDI ID) and
    /// the MPS limits in its CDI spec.
    async fn prepare_ok(&self, s: &Share, what: &str) {
        let want = PreparedDevice {
            requests: vec!["gpus".into()],
            pool: NODE.into(),
            device: DEVICE.into(),
            cdi_ids: cdi_ids(&s.claim, &[GPU]),
            share_id: Some(s.id.into()),
        };
        assert_eq!(
            self.prepare_share(&s.claim).await,
            Ok(vec![want]),
            "{what}: the prepare of {} answers its share",
            s.claim.name
        );
        let spec: gpuplane_node::cdi::Spec =
            serde_json::from_slice(&std::fs::read(self.spec_path(&s.claim)).unwrap()).unwrap();
        let env: Vec<String> = spec
            .devices
            .iter()
            .flat_map(|d| d.container_edits.env.clone())
            .collect();
        for want in [
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50".to_string(),
            format!("CUDA_MPS_PIPE_DIRECTORY={}", self.pipe().display()),
            "GPUPLANE_SHARE_ENFORCEMENT=MPS".to_string(),
        ] {
            assert!(
                env.contains(&want),
                "{what}: {want} in the spec of {}: {env:?}",
                s.claim.name
            );
        }
    }

    async fn unprepare_ok(&self, s: &Share, what: &str) {
        self.unprepare(&s.claim)
            .await
            .unwrap_or_else(|e| panic!("{what}: unprepare of {}: {e}", s.claim.name));
        assert!(
            !self.spec_path(&s.claim).exists(),
            "{what}: no CDI spec of {} is left",
            s.claim.name
        );
        assert!(
            !self.checkpoint().claims.contains_key(s.claim.uid.as_str()),
            "{what}: the checkpoint no longer lists {}",
            s.claim.name
        );
    }

    /// The one live daemon serving the GPU, which its pid file names and whose log records one
    /// start (it was not restarted in place); panics unless exactly one runs.
    fn one_daemon(&self, what: &str) -> u32 {
        let pipe = self.pipe();
        let live = daemons(|p| p == pipe);
        let [pid] = live[..] else {
            panic!(
                "{what}: exactly one live MPS control daemon serves {}, found {live:?}\n{}",
                self.uuid(),
                self.log()
            );
        };
        let recorded =
            std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid")).unwrap_or_default();
        assert_eq!(recorded.trim(), pid.to_string(), "{what}: the pid file");
        let log =
            std::fs::read_to_string(self.mps_dir().join("log/control.log")).unwrap_or_default();
        assert_eq!(log.matches(" start ").count(), 1, "{what}: {log}");
        pid
    }

    /// No live daemon serves the GPU and its directory is gone.
    fn no_daemon(&self, what: &str) {
        let pipe = self.pipe();
        let live = daemons(|p| p == pipe);
        assert!(
            live.is_empty(),
            "{what}: no MPS control daemon serves {}, found {live:?}\n{}",
            self.uuid(),
            self.log()
        );
        assert!(
            !self.mps_dir().exists(),
            "{what}: {} is removed",
            self.mps_dir().display()
        );
    }

    /// The ledger from the outside, while exactly `holders` hold their shares of the GPU:
    /// ListAndWatch withdraws it and no other, Allocate of it is refused naming a holder, and a
    /// share asking the whole GPU is refused naming exactly these holders and what is left.
    /// With no holder: every GPU is offered and nothing is held.
    async fn check_held(&self, holders: &[&Share], what: &str) {
        if holders.is_empty() {
            self.check_ledger(&[], "").await;
            return;
        }
        let uuid = self.uuid().to_string();
        let gpus = self.uuids.len();
        let seen = self
            .kubelet
            .wait_for(WAIT, |p| {
                p.get(GPU_RESOURCE).is_some_and(|v| {
                    v.devices.len() == gpus
                        && v.devices
                            .iter()
                            .all(|d| (d.health == "Unhealthy") == (d.id == uuid))
                })
            })
            .await;
        assert!(
            seen.is_ok(),
            "{what}: ListAndWatch withdraws exactly the shared GPU: {seen:?}"
        );
        let err = self
            .kubelet
            .allocate(GPU_RESOURCE, std::slice::from_ref(&uuid))
            .await
            .unwrap_err();
        assert!(
            holders
                .iter()
                .any(|h| err.message().contains(&holder(h.name))),
            "{what}: {}",
            err.message()
        );

        let n = self.probes.get() + 1;
        self.probes.set(n);
        let probe = self.share_claim(
            &format!("probe-{n}"),
            &format!("5ab3c1d0-0000-4000-8000-{n:012}"),
            "80Gi",
            "100",
        );
        let err = self.prepare_share(&probe).await.unwrap_err();
        let free = match holders.len() {
            1 => "40Gi memory and 50% compute are free",
            _ => "0 memory and 0% compute are free",
        };
        assert!(err.contains(free), "{what}: {err}");
        for (name, _) in SHARES {
            let held = holders.iter().any(|h| h.name == name);
            assert_eq!(
                err.contains(&holder(name)),
                held,
                "{what}: the ledger holds the share of {name}: {held}; {err}"
            );
        }
    }

    /// After the last share's unprepare: no daemon, no directory, no share recorded, the whole
    /// GPU offered again, and a claim of the whole GPU prepared (it runs no daemon).
    async fn check_free(&self, what: &str) {
        self.no_daemon(what);
        assert!(
            self.checkpoint()
                .claims
                .values()
                .all(|e| e.shares.is_empty()),
            "{what}: no share is recorded"
        );
        self.check_held(&[], what).await;
        let whole = self.claim(&format!("whole-{}", self.runs), &[GPU]);
        assert_eq!(
            self.prepare(&whole).await,
            Ok(cdi_ids(&whole, &[GPU])),
            "{what}: the whole GPU is free"
        );
        self.no_daemon(what);
    }
}

/// One of the two share claims, as stored on the API server double.
struct Share {
    name: &'static str,
    id: &'static str,
    claim: ClaimRef,
}

/// The two shares' claim names and shareIDs.
const SHARES: [(&str, &str); 2] = [
    ("share-a", "5ab3c1d0-0000-4000-8000-0000000000aa"),
    ("share-b", "5ab3c1d0-0000-4000-8000-0000000000bb"),
];

/// How the ledger names the holder of claim `name`.
fn holder(name: &str) -> String {
    format!("ResourceClaim team-a/{name} (")
}

impl SharesNode {
    /// The two share claims, on this node's API server double.
    fn shares(&self) -> (Share, Share) {
        let [a, b] = SHARES.map(|(name, id)| Share {
            name,
            id,
            claim: self.share_claim(name, id, MEMORY, COMPUTE),
        });
        (a, b)
    }
}

/// A case: the crash point armed (`#2`: its second reach), whether it lands in the second
/// share's prepare or unprepare (the first is then prepared, or unprepared, already), and
/// whether the checkpoint still records the crashed claim after it.
struct Case {
    arm: &'static str,
    second: bool,
    recorded: bool,
}

const PREPARE_CASES: [Case; 6] = [
    // Only the GPU's first share starts its daemon, so only its prepare reaches this step:
    // the daemon runs and nothing records a share.
    Case {
        arm: "prepare.after-mps-start",
        second: false,
        recorded: false,
    },
    // The second share is held in memory only; the daemon runs for the first.
    Case {
        arm: "prepare.before-checkpoint#2",
        second: true,
        recorded: false,
    },
    Case {
        arm: "prepare.after-checkpoint",
        second: false,
        recorded: true,
    },
    Case {
        arm: "prepare.after-checkpoint#2",
        second: true,
        recorded: true,
    },
    Case {
        arm: "prepare.after-cdi-spec",
        second: false,
        recorded: true,
    },
    Case {
        arm: "prepare.after-cdi-spec#2",
        second: true,
        recorded: true,
    },
];

const UNPREPARE_CASES: [Case; 6] = [
    Case {
        arm: "unprepare.before-spec-removal",
        second: false,
        recorded: true,
    },
    Case {
        arm: "unprepare.before-spec-removal#2",
        second: true,
        recorded: true,
    },
    // The spec is gone, the checkpoint still lists the share: the restart writes the spec back.
    Case {
        arm: "unprepare.after-spec-removal",
        second: false,
        recorded: true,
    },
    Case {
        arm: "unprepare.after-checkpoint",
        second: false,
        recorded: false,
    },
    Case {
        arm: "unprepare.after-checkpoint#2",
        second: true,
        recorded: false,
    },
    // Only the GPU's last share stops its daemon, so only its unprepare reaches this step.
    Case {
        arm: "unprepare.before-mps-stop",
        second: true,
        recorded: false,
    },
];

/// Restarts the killed agent, checking the files before and after (as tests/it/crash.rs does).
async fn restart(node: &mut SharesNode) {
    node.check_files(false);
    node.start(None).await;
    node.check_files(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_at_any_step_of_a_share_prepare_then_the_retried_prepare_answers_the_share() {
    for case in PREPARE_CASES {
        let what = case.arm;
        let mut node = SharesNode::new().await;
        node.start(Some(case.arm)).await;
        let (a, b) = node.shares();
        let (first, other) = if case.second { (&b, &a) } else { (&a, &b) };
        let mut daemon = None;
        if case.second {
            node.prepare_ok(&a, what).await;
            daemon = Some(node.one_daemon(what));
        }

        node.prepare_until_crash(&first.claim).await;
        // Every step here comes after the daemon's start.
        let at_kill = node.one_daemon(&format!("{what}: at the kill"));
        if let Some(pid) = daemon {
            assert_eq!(
                at_kill, pid,
                "{what}: the second share uses the running daemon"
            );
        }
        restart(&mut node).await;

        let recorded = node
            .checkpoint()
            .claims
            .contains_key(first.claim.uid.as_str());
        assert_eq!(
            recorded, case.recorded,
            "{what}: the checkpoint lists the claim"
        );
        let mut held: Vec<&Share> = Vec::new();
        if case.second {
            held.push(&a);
        }
        if case.recorded {
            held.push(first);
        }
        let after = format!("{what}: after the restart");
        if held.is_empty() {
            // The daemon of no recorded share is stopped at start.
            node.no_daemon(&after);
        } else {
            assert_eq!(node.one_daemon(&after), at_kill, "{after}: adopted");
        }
        node.check_held(&held, &after).await;

        node.prepare_ok(first, &format!("{what}: the retried prepare"))
            .await;
        let pid = node.one_daemon(&format!("{what}: after the retried prepare"));
        if !held.is_empty() {
            assert_eq!(
                pid, at_kill,
                "{what}: the retried prepare adopts the daemon"
            );
        }
        if !case.second {
            node.prepare_ok(other, what).await;
            assert_eq!(
                node.one_daemon(what),
                pid,
                "{what}: one daemon serves both shares"
            );
        }
        node.check_held(&[&a, &b], &format!("{what}: both prepared"))
            .await;

        node.unprepare_ok(&a, what).await;
        assert_eq!(
            node.one_daemon(&format!("{what}: one share left")),
            pid,
            "{what}: the daemon serves the share left"
        );
        node.check_held(&[&b], &format!("{what}: one share left"))
            .await;
        node.unprepare_ok(&b, what).await;
        node.check_free(&format!("{what}: every share unprepared"))
            .await;
        node.check_files(true);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_at_any_step_of_a_share_unprepare_then_the_last_unprepare_stops_the_daemon() {
    for case in UNPREPARE_CASES {
        let what = case.arm;
        let mut node = SharesNode::new().await;
        node.start(Some(case.arm)).await;
        let (a, b) = node.shares();
        node.prepare_ok(&a, what).await;
        let pid = node.one_daemon(what);
        node.prepare_ok(&b, what).await;
        assert_eq!(node.one_daemon(what), pid, "{what}: one daemon serves both");
        let (first, other) = if case.second {
            node.unprepare_ok(&a, what).await;
            assert_eq!(
                node.one_daemon(what),
                pid,
                "{what}: the second share is left on it"
            );
            (&b, None)
        } else {
            (&a, Some(&b))
        };

        node.unprepare_until_crash(&first.claim).await;
        // Every step here comes before the daemon's stop.
        assert_eq!(
            node.one_daemon(&format!("{what}: at the kill")),
            pid,
            "{what}"
        );
        restart(&mut node).await;

        let recorded = node
            .checkpoint()
            .claims
            .contains_key(first.claim.uid.as_str());
        assert_eq!(
            recorded, case.recorded,
            "{what}: the checkpoint lists the claim"
        );
        let held: Vec<&Share> = other
            .into_iter()
            .chain(case.recorded.then_some(first))
            .collect();
        let after = format!("{what}: after the restart");
        if held.is_empty() {
            // The daemon of no recorded share is stopped at start.
            node.no_daemon(&after);
        } else {
            assert_eq!(node.one_daemon(&after), pid, "{after}: adopted");
        }
        node.check_held(&held, &after).await;

        let retried = format!("{what}: the retried unprepare");
        node.unprepare_ok(first, &retried).await;
        if let Some(other) = other {
            assert_eq!(
                node.one_daemon(&retried),
                pid,
                "{retried}: the other share keeps it"
            );
            node.check_held(&[other], &retried).await;
            node.unprepare_ok(other, what).await;
        }
        node.check_free(&format!("{what}: every share unprepared"))
            .await;
        node.check_files(true);
    }
}
