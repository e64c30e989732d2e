//! The crash tests' node (tests/it/crash.rs, tests/it/crash_shares.rs): a directory, the API server
//! double and both kubelet doubles in the test process, and the real agent binary as a child
//! process that a test arms at a crash point, kills there and restarts, then checks from the
//! outside (files, ListAndWatch, metrics). Needs `mod support;` in the including crate.
#![allow(dead_code)]

use crate::support::{self, eventually, AgentProcess, DRIVER};
use gpuplane_node::dra::checkpoint::{self, CheckpointData};
use gpuplane_node::dra::ClaimRef;
use gpuplane_testkit::doubles::apiserver::ApiServerDouble;
use gpuplane_testkit::doubles::kubelet::KubeletDouble;
use gpuplane_testkit::doubles::kubelet_dra::{KubeletDraDouble, KubeletDraOptions};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// A hang guard for waits, never a timing assertion.
pub const WAIT: Duration = Duration::from_secs(30);
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

/// One node: a directory, the doubles in this process and the agent as a child process.
pub struct Node {
    pub dir: tempfile::TempDir,
    pub api: ApiServerDouble,
    pub kubelet: Arc<KubeletDouble>,
    pub dra: Arc<KubeletDraDouble>,
    pub agent: Option<AgentProcess>,
    /// GPU index -> UUID (the device plugin's device IDs).
    pub uuids: Vec<String>,
    /// Devices the device plugin offers for `nvidia.com/gpu` (GPUs, or MIG devices).
    pub dp_devices: usize,
    pub profile: String,
    pub config: String,
    pub runs: usize,
    /// Devices from the fake libnvidia-ml (its path) instead of `--simulate`, with the fake's
    /// state file, so MIG instances outlive a killed agent as they do in a real driver.
    pub nvml: Option<(PathBuf, PathBuf)>,
    /// More arguments and environment for every agent started from now on.
    pub extra_args: Vec<String>,
    pub extra_env: Vec<(String, std::ffi::OsString)>,
}

impl Node {
    pub async fn new(profile: &str, config: &str) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let api = ApiServerDouble::start().await.unwrap();
        let kubelet_root = dir.path().join("kubelet");
        let kubelet = Arc::new(KubeletDouble::start(&kubelet_root).await.unwrap());
        let dra = Arc::new(KubeletDraDouble::start(
            &kubelet_root,
            KubeletDraOptions::default(),
        ));
        let uuids: Vec<String> = gpuplane_model::sim::load(profile)
            .unwrap()
            .gpus
            .iter()
            .map(|g| g.uuid.to_string())
            .collect();
        support::lay_out_node(dir.path(), uuids.len(), &api.url());
        Node {
            dir,
            api,
            kubelet,
            dra,
            agent: None,
            dp_devices: uuids.len(),
            uuids,
            profile: profile.to_string(),
            config: config.to_string(),
            runs: 0,
            nvml: None,
            extra_args: Vec::new(),
            extra_env: Vec::new(),
        }
    }

    /// [`Node::new`] with the agent reading the fake libnvidia-ml (built from the same
    /// profile) and the fake keeping its MIG instances in `<node>/fake-nvml-state.json`.
    pub async fn with_fake_nvml(profile: &str, config: &str) -> Node {
        let mut node = Node::new(profile, config).await;
        let state = node.path("fake-nvml-state.json");
        node.nvml = Some((support::built_fake().to_path_buf(), state));
        node
    }

    pub fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    pub fn marker(&self) -> PathBuf {
        self.path("crashpoint-reached")
    }

    /// Starts the agent, armed at `crash` if given, without waiting for anything.
    pub fn spawn(&mut self, crash: Option<&str>) {
        assert!(self.agent.is_none(), "an agent is running");
        self.runs += 1;
        let _ = std::fs::remove_file(self.marker());
        let marker = self.marker().into_os_string();
        let spec = crash.map(std::ffi::OsString::from);
        let mut env: Vec<(&str, &std::ffi::OsStr)> =
            vec![("GPUPLANE_CRASHPOINT_MARKER", marker.as_os_str())];
        if let Some(s) = &spec {
            env.push(("GPUPLANE_CRASHPOINT", s.as_os_str()));
        }
        let profile = std::ffi::OsString::from(&self.profile);
        let mut source: Vec<&str> = match &self.nvml {
            Some((lib, state)) => {
                env.push(("GPUPLANE_FAKE_NVML_PROFILE", profile.as_os_str()));
                env.push(("GPUPLANE_FAKE_NVML_STATE", state.as_os_str()));
                vec!["--nvml-lib", lib.to_str().unwrap()]
            }
            None => vec!["--simulate", &self.profile],
        };
        source.extend(self.extra_args.iter().map(String::as_str));
        env.extend(
            self.extra_env
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_os_str())),
        );
        self.agent = Some(AgentProcess::spawn(
            self.dir.path(),
            &self.config,
            &source,
            &env,
            &self.runs.to_string(),
        ));
    }

    /// Starts the agent and waits until both kubelet doubles have it registered anew, with
    /// ListAndWatch answering from the new process.
    pub async fn start(&mut self, crash: Option<&str>) {
        let dra_before = self.dra_registrations();
        let dp_before = self.kubelet.registrations().len();
        self.spawn(crash);
        let what = format!(
            "agent run {} to register with both kubelet doubles",
            self.runs
        );
        let (dra, kubelet) = (self.dra.clone(), self.kubelet.clone());
        let gpus = self.dp_devices;
        let ok = tokio::time::timeout(WAIT, async {
            dra.wait_until(WAIT, "a new DRA registration", |k| {
                registrations_ok(k) > dra_before && k.plugin(DRIVER).is_some()
            })
            .await?;
            kubelet
                .wait_for(WAIT, |p| {
                    p.get(GPU_RESOURCE).is_some_and(|v| v.devices.len() == gpus)
                })
                .await?;
            // The previous run's devices may still be listed: wait for the new registration
            // itself too.
            while kubelet.registrations().len() <= dp_before {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Ok::<_, String>(())
        })
        .await;
        let registered = matches!(ok, Ok(Ok(()))) && self.kubelet.registrations().len() > dp_before;
        assert!(registered, "{what}: {ok:?}\n{}", self.log());
    }

    pub fn dra_registrations(&self) -> usize {
        registrations_ok(&self.dra)
    }

    pub fn log(&self) -> String {
        self.agent
            .as_ref()
            .map(AgentProcess::log_text)
            .unwrap_or_default()
    }

    pub async fn wait_marker(&self) {
        let marker = self.marker();
        let log = self.agent.as_ref().map(|a| a.log.clone()).unwrap();
        eventually("the crash point", WAIT, || marker.exists()).await;
        assert!(
            std::fs::read_to_string(&log)
                .unwrap()
                .contains("crash point reached"),
            "the agent logged where it stopped"
        );
    }

    /// SIGKILL, then wait until the device plugin double saw its stream end.
    pub async fn kill(&mut self) {
        self.agent.take().expect("a running agent").kill();
        let kubelet = self.kubelet.clone();
        eventually("the kubelet double to notice the dead plugin", WAIT, || {
            kubelet
                .plugin(GPU_RESOURCE)
                .is_none_or(|v| v.devices.iter().all(|d| d.health == "Unhealthy"))
        })
        .await;
    }

    /// Calls NodePrepareResources for `c`, expects the agent to stop at its armed crash point
    /// instead of answering, and kills it there.
    pub async fn prepare_until_crash(&mut self, c: &ClaimRef) {
        let dra = self.dra.clone();
        let claim = c.clone();
        let call = tokio::spawn(async move { dra.prepare(DRIVER, &[claim]).await });
        self.wait_marker().await;
        assert!(!call.is_finished(), "prepare answered past the crash point");
        self.kill().await;
        let answer = call.await.unwrap();
        assert!(answer.is_err(), "a killed agent answered: {answer:?}");
    }

    pub async fn unprepare_until_crash(&mut self, c: &ClaimRef) {
        let dra = self.dra.clone();
        let claim = c.clone();
        let call = tokio::spawn(async move { dra.unprepare(DRIVER, &[claim]).await });
        self.wait_marker().await;
        assert!(
            !call.is_finished(),
            "unprepare answered past the crash point"
        );
        self.kill().await;
        assert!(call.await.unwrap().is_err());
    }

    /// A claim allocated by the (absent) scheduler to GPUs `gpus` of this node.
    pub fn claim(&self, name: &str, gpus: &[usize]) -> ClaimRef {
        let devices: Vec<String> = gpus.iter().map(|g| format!("gpu-{g}")).collect();
        let devices: Vec<&str> = devices.iter().map(String::as_str).collect();
        support::put_claim(&self.api, name, &devices)
    }

    /// The CDI IDs NodePrepareResources answered for `c`, or the claim's error.
    pub async fn prepare(&self, c: &ClaimRef) -> Result<Vec<String>, String> {
        let mut out = self
            .dra
            .prepare(DRIVER, std::slice::from_ref(c))
            .await
            .map_err(|s| s.message().to_string())?;
        let mut ids: Vec<String> = out
            .remove(c.uid.as_str())
            .unwrap()?
            .into_iter()
            .flat_map(|d| d.cdi_ids)
            .collect();
        ids.sort();
        Ok(ids)
    }

    pub async fn unprepare(&self, c: &ClaimRef) -> Result<(), String> {
        let mut out = self
            .dra
            .unprepare(DRIVER, std::slice::from_ref(c))
            .await
            .map_err(|s| s.message().to_string())?;
        out.remove(c.uid.as_str()).unwrap()
    }

    pub fn spec_path(&self, c: &ClaimRef) -> PathBuf {
        self.path(&format!("cdi/gpuplane-claim-{}.json", c.uid))
    }

    /// The newest checkpoint slot (check_files checks that every slot decodes).
    pub fn checkpoint(&self) -> CheckpointData {
        checkpoint::read(&self.path("state")).unwrap_or_else(|| CheckpointData::empty(""))
    }

    /// Nobody can read half a file: every spec a runtime would load (`*.json`) is a whole CDI
    /// spec, and the checkpoint decodes (checksum included). With `restarted`, also: no
    /// temporary file of an earlier run is left (the running agent's own are writes in flight:
    /// it may be rewriting its node spec as the check reads the directory) and nothing was set
    /// aside as corrupt. The MPS control daemons'
    /// directories (`state/mps`, crates/node/src/mps/process.rs) are the daemons' own.
    pub fn check_files(&self, restarted: bool) {
        for dir in ["cdi", "state"] {
            for entry in std::fs::read_dir(self.path(dir)).into_iter().flatten() {
                let entry = entry.unwrap();
                let name = entry.file_name().to_string_lossy().into_owned();
                if dir == "state" && name == "mps" && entry.path().is_dir() {
                    continue;
                }
                let bytes = match std::fs::read(entry.path()) {
                    Ok(b) => b,
                    // Renamed into place by the running agent since the listing.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => panic!("{name}: {e}"),
                };
                if name.starts_with('.') {
                    assert!(name.contains(".tmp-"), "unexpected hidden file {name}");
                    let in_flight = self
                        .agent
                        .as_ref()
                        .is_some_and(|a| name.contains(&format!(".tmp-{}-", a.pid())));
                    assert!(
                        !restarted || in_flight,
                        "{name} left behind after the restart"
                    );
                } else if dir == "cdi" {
                    assert!(name.ends_with(".json"), "{name}");
                    let spec: gpuplane_node::cdi::Spec = serde_json::from_slice(&bytes)
                        .unwrap_or_else(|e| panic!("{name} is not a whole CDI spec: {e}"));
                    assert!(!spec.devices.is_empty(), "{name} has no devices");
                } else if name == gpuplane_node::node::lock::FILE_NAME {
                    // The one-agent lock (node/lock.rs); it holds a PID, not state.
                } else {
                    assert!(
                        checkpoint::SLOTS.contains(&name.as_str()),
                        "{name}: nothing set aside as corrupt"
                    );
                    checkpoint::decode(&bytes).expect("each checkpoint slot decodes");
                }
            }
        }
    }

    /// The ledger from the outside: exactly the GPUs in `held` are withdrawn from ListAndWatch
    /// (the rest healthy), `gpuplane_ledger_held_units{api="dra"}` counts them, Allocate of
    /// the first is refused naming `holder`, and so is another claim for it.
    pub async fn check_ledger(&self, held: &[usize], holder: &str) {
        let want: BTreeSet<String> = held.iter().map(|g| self.uuids[*g].clone()).collect();
        let kubelet = self.kubelet.clone();
        let gpus = self.uuids.len();
        let seen = kubelet
            .wait_for(WAIT, |p| {
                p.get(GPU_RESOURCE).is_some_and(|v| {
                    v.devices.len() == gpus
                        && v.devices
                            .iter()
                            .all(|d| (d.health == "Unhealthy") == want.contains(&d.id))
                })
            })
            .await;
        assert!(
            seen.is_ok(),
            "ListAndWatch withdraws exactly {held:?}: {seen:?}"
        );
        let agent = self.agent.as_ref().unwrap();
        let metric = r#"gpuplane_ledger_held_units{api="dra"}"#;
        eventually("the held-units metric", WAIT, || {
            agent.metric(metric) == Some(held.len() as f64)
        })
        .await;
        let Some(first) = held.first() else { return };
        let err = self
            .kubelet
            .allocate(GPU_RESOURCE, &[self.uuids[*first].clone()])
            .await
            .unwrap_err();
        assert!(
            err.message()
                .contains(&format!("ResourceClaim team-a/{holder}")),
            "{}",
            err.message()
        );
        let probe = self.claim(&format!("probe-{}", self.runs), &[*first]);
        let err = self.prepare(&probe).await.unwrap_err();
        assert!(err.contains("held by"), "{err}");
    }

    /// The unit holds the checkpoint on disk implies for `c`: its GPUs if listed, else none.
    pub fn held_by_checkpoint(&self, c: &ClaimRef, gpus: &[usize]) -> Vec<usize> {
        if self.checkpoint().claims.contains_key(c.uid.as_str()) {
            gpus.to_vec()
        } else {
            Vec::new()
        }
    }

    /// After an unprepare: no spec, no checkpoint entry, every unit free and a new claim for
    /// the same GPUs is prepared.
    pub async fn check_gone(&self, c: &ClaimRef, gpus: &[usize]) {
        assert!(
            !self.spec_path(c).exists(),
            "the CDI spec of an unprepared claim is gone"
        );
        assert!(!self.checkpoint().claims.contains_key(c.uid.as_str()));
        self.check_ledger(&[], "").await;
        let next = self.claim(&format!("next-{}", self.runs), gpus);
        assert_eq!(self.prepare(&next).await.unwrap(), cdi_ids(&next, gpus));
    }
}

pub fn registrations_ok(k: &KubeletDraDouble) -> usize {
    k.registrations()
        .iter()
        .filter(|r| r.driver == DRIVER && r.outcome.is_ok())
        .count()
}

/// What a prepare of `c` must answer: one CDI device per allocated GPU.
pub fn cdi_ids(c: &ClaimRef, gpus: &[usize]) -> Vec<String> {
    let mut ids: Vec<String> = gpus
        .iter()
        .map(|g| format!("k8s.{DRIVER}/claim={}-gpu-{g}", c.uid))
        .collect();
    ids.sort();
    ids
}
