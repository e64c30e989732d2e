//! A stand-in for the kubelet and container runtime of one node, for MPS daemon pods only
//! (`gpuplane_node::mps::pods`): it watches the API server for the node's pods labelled
//! `app.kubernetes.io/name=gpuplane-mps`, runs each one's container as the runtime would (its
//! arguments after the image's entrypoint, the gpuplane binary; its host-path volumes at the
//! same paths, as the agent renders them; its `/dev/shm` volume as the stand-in MPS daemon's shm
//! directory, `GPUPLANE_FAKE_MPS_SHM`), starts it again when it ends (`restartPolicy: Always`),
//! and stops it with SIGTERM once the pod is gone, as the kubelet does on deletion. The real kubelet and containerd run these pods in tests/lab.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use tokio::task::JoinHandle;

/// The variable the stand-in MPS daemon reads its `/dev/shm` from (hack/fake-mps).
const SHM_ENV: &str = "GPUPLANE_FAKE_MPS_SHM";

type Children = Arc<Mutex<BTreeMap<String, Child>>>;

/// Runs the node's MPS daemon pods until dropped.
pub struct PodRunner {
    task: JoinHandle<()>,
    children: Children,
    started: Arc<Mutex<Vec<String>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn terminate(mut child: Child) {
    // Best effort: a child that already ended is simply reaped.
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
}

/// A daemon pod's container: `program` with its arguments and `env`, its shm volume as the
/// stand-in's.
fn run(program: &Path, env: &[(String, String)], pod: &Pod) -> Option<Child> {
    let spec = pod.spec.as_ref()?;
    let args = spec.containers.first()?.args.clone().unwrap_or_default();
    let shm = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "shm")
        .and_then(|v| v.host_path.as_ref())
        .map(|h| PathBuf::from(&h.path))?;
    // hostPath type DirectoryOrCreate.
    std::fs::create_dir_all(&shm).ok()?;
    Command::new(program)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env(SHM_ENV, shm)
        // The daemon logs to its log directory; its container's output would only clutter.
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()
}

impl PodRunner {
    /// Starts running `namespace`'s daemon pods of `node` with `program` (the gpuplane binary).
    pub fn start(client: kube::Client, namespace: &str, node: &str, program: &Path) -> PodRunner {
        PodRunner::start_with_env(client, namespace, node, program, Vec::new())
    }

    /// [`PodRunner::start`], the containers' processes also getting `env`: what the host
    /// gives every process there (the fake libnvidia-ml's profile and state file, say).
    pub fn start_with_env(
        client: kube::Client,
        namespace: &str,
        node: &str,
        program: &Path,
        env: Vec<(String, String)>,
    ) -> PodRunner {
        let api: Api<Pod> = Api::namespaced(client, namespace);
        let params = ListParams::default()
            .labels("app.kubernetes.io/name=gpuplane-mps")
            .fields(&format!("spec.nodeName={node}"));
        let children: Children = Arc::default();
        let started: Arc<Mutex<Vec<String>>> = Arc::default();
        let (kids, log, program) = (children.clone(), started.clone(), program.to_path_buf());
        let task = tokio::spawn(async move {
            loop {
                if let Ok(list) = api.list(&params).await {
                    let pods: BTreeMap<String, Pod> = list
                        .items
                        .into_iter()
                        .filter(|p| p.metadata.deletion_timestamp.is_none())
                        .filter_map(|p| Some((p.metadata.name.clone()?, p)))
                        .collect();
                    let gone: Vec<Child> = {
                        let mut running = lock(&kids);
                        // A container that ended is started again (restartPolicy: Always).
                        running.retain(|_, c| matches!(c.try_wait(), Ok(None)));
                        let names: Vec<String> = running
                            .keys()
                            .filter(|n| !pods.contains_key(*n))
                            .cloned()
                            .collect();
                        names.iter().filter_map(|n| running.remove(n)).collect()
                    };
                    gone.into_iter().for_each(terminate);
                    for (name, pod) in pods {
                        if lock(&kids).contains_key(&name) {
                            continue;
                        }
                        // Recorded before the spawn: whatever the new container does is
                        // seen after its start is (this task may be descheduled right after
                        // the spawn, long enough for the container to serve).
                        let mut started = lock(&log);
                        started.push(name.clone());
                        match run(&program, &env, &pod) {
                            Some(child) => {
                                lock(&kids).insert(name, child);
                            }
                            None => {
                                started.pop();
                            }
                        }
                    }
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        });
        PodRunner {
            task,
            children,
            started,
        }
    }

    /// The process of pod `name`'s container now.
    pub fn pid(&self, name: &str) -> Option<u32> {
        lock(&self.children).get(name).map(Child::id)
    }

    /// Every pod started so far, in order (a name twice: started again).
    pub fn started(&self) -> Vec<String> {
        lock(&self.started).clone()
    }
}

impl Drop for PodRunner {
    fn drop(&mut self) {
        self.task.abort();
        let children: Vec<Child> = std::mem::take(&mut *lock(&self.children))
            .into_values()
            .collect();
        children.into_iter().for_each(terminate);
    }
}
