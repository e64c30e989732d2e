//! The pod that runs one shared unit's MPS control daemon (pure rendering).
//!
//! Why a pod of its own: a process keeps its parent's cgroup and PID namespace, so a daemon
//! the agent starts dies with the agent's container (an upgrade, an eviction, an OOM kill),
//! and with it every share's CUDA context. NVIDIA's DRA driver runs each daemon in a pod the
//! plugin creates, finds again after its own restart and deletes at unprepare
//! (kubernetes-sigs/dra-driver-nvidia-gpu, cmd/gpu-kubelet-plugin/sharing.go and
//! templates/mps-control-daemon.tmpl.yaml); gpuplane does the same, one pod per shared unit.
//!
//! What the pod gets, and why (least privilege otherwise):
//! - `nodeName`: it must run beside its GPU; no scheduler decision to wait for.
//! - the agent's image, pull policy, pull secrets, tolerations and priority class, read from
//!   the agent's own pod, so it runs wherever the agent runs and from the same build;
//! - `privileged`: the daemon opens the GPU's device nodes and no allocation API can hand a
//!   GPU that shares already hold to one more consumer; root, as the agent;
//! - `hostPID`: the MPS server must see its clients' PIDs (NVIDIA's template does the same);
//! - three host paths: the unit's directory under the state dir (pipe and log directories,
//!   at the same path as on the host, so clients and the agent name the same files), the
//!   unit's shm directory as `/dev/shm` (MPS clients need the server's `/dev/shm`; each share
//!   container gets the same directory there) and the driver root, read-only;
//! - no service account token: it never calls the API server;
//! - an owner reference to the agent's DaemonSet (not a controller reference, so the
//!   DaemonSet controller leaves it alone): uninstalling deletes it, an upgrade does not.
//! - no memory limit: an OOM kill would end every share of the GPU.

use crate::sharing::ENV_MPS_PIPE;
use k8s_openapi::api::core::v1::{
    Container, HostPathVolumeSource, LocalObjectReference, Pod, PodSpec, ResourceRequirements,
    SecurityContext, Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// `app.kubernetes.io/name` of every daemon pod: what the agent lists its daemons by (with
/// the field selector `spec.nodeName`).
pub const APP: &str = "gpuplane-mps";
/// The annotation naming the unit (GPU or MIG device UUID) a daemon pod serves. An
/// annotation, not a label: older MIG UUIDs hold `/`, which no label value may.
pub const UNIT_ANNOTATION: &str = "gpuplane.dev/mps-unit";
/// The container's name.
pub const CONTAINER: &str = "mps-control-daemon";
/// The subcommand the pod runs (the image's entrypoint is the gpuplane binary).
pub const SUBCOMMAND: &str = "mps-daemon";

/// What the daemon pods copy from the agent's own pod.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AgentPod {
    pub namespace: String,
    pub image: String,
    pub image_pull_policy: Option<String>,
    pub image_pull_secrets: Vec<String>,
    pub tolerations: Vec<Toleration>,
    pub priority_class_name: Option<String>,
    /// The agent's DaemonSet, when its pod has one as controller.
    pub owner: Option<OwnerReference>,
}

impl AgentPod {
    /// Reads what daemon pods copy from the agent's pod object; an error names what is
    /// missing.
    pub fn from_pod(pod: &Pod, container: Option<&str>) -> Result<AgentPod, String> {
        let name = pod.metadata.name.as_deref().unwrap_or("?");
        let spec = pod
            .spec
            .as_ref()
            .ok_or_else(|| format!("pod {name} has no spec"))?;
        let c = match container {
            Some(want) => spec.containers.iter().find(|c| c.name == want),
            None => spec.containers.first(),
        }
        .ok_or_else(|| format!("pod {name} has no container {}", container.unwrap_or("")))?;
        let image = c
            .image
            .clone()
            .filter(|i| !i.is_empty())
            .ok_or_else(|| format!("container {} of pod {name} names no image", c.name))?;
        let owner = pod
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true) && o.kind == "DaemonSet")
            .map(|o| OwnerReference {
                controller: None,
                block_owner_deletion: None,
                ..o.clone()
            });
        Ok(AgentPod {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            image,
            image_pull_policy: c.image_pull_policy.clone(),
            image_pull_secrets: spec
                .image_pull_secrets
                .iter()
                .flatten()
                .map(|s| s.name.clone())
                .collect(),
            tolerations: spec.tolerations.clone().unwrap_or_default(),
            priority_class_name: spec.priority_class_name.clone(),
            owner,
        })
    }
}

/// Where one unit's daemon keeps its files on the host: `<state>/mps/<unit>/{pipe,log,shm}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonDirs {
    pub root: String,
    pub pipe: String,
    pub log: String,
    pub shm: String,
}

impl DaemonDirs {
    pub fn new(state_dir: &str, unit: &str) -> DaemonDirs {
        let root = format!("{}/mps/{unit}", state_dir.trim_end_matches('/'));
        DaemonDirs {
            pipe: format!("{root}/pipe"),
            log: format!("{root}/log"),
            shm: format!("{root}/shm"),
            root,
        }
    }
}

/// One daemon pod to render.
#[derive(Debug, Clone)]
pub struct DaemonPod<'a> {
    pub node: &'a str,
    pub unit: &'a str,
    pub multiuser: bool,
    pub agent: &'a AgentPod,
    /// The agent's state directory (host path, mounted at the same path).
    pub state_dir: &'a str,
    /// The driver root as the host sees it, and where it is mounted (the agent's
    /// `--driver-root-mount`, or the same path).
    pub driver_root: &'a str,
    pub driver_root_mount: &'a str,
    /// The agent's libnvidia-ml (under the driver root, so at the same path in the pod): the
    /// daemon sets its GPU's compute mode through it. `None`: simulated devices, no mode.
    pub nvml_lib: Option<&'a str>,
}

/// The daemon pod's name: stable for a (node, unit), so the agent finds it again after a
/// restart, and short whatever the node's name.
pub fn pod_name(node: &str, unit: &str) -> String {
    let digest = Sha256::digest(format!("{node}\0{unit}").as_bytes());
    let hex: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("{APP}-{hex}")
}

fn host_path(name: &str, path: &str, kind: &str) -> Volume {
    Volume {
        name: name.into(),
        host_path: Some(HostPathVolumeSource {
            path: path.into(),
            type_: Some(kind.into()),
        }),
        ..Default::default()
    }
}

fn mount(name: &str, at: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: at.into(),
        read_only: read_only.then_some(true),
        ..Default::default()
    }
}

impl DaemonPod<'_> {
    /// The container's arguments (after the image's entrypoint).
    pub fn args(&self) -> Vec<String> {
        let mut args = vec![
            SUBCOMMAND.to_string(),
            format!("--unit={}", self.unit),
            format!("--state-dir={}", self.state_dir),
            format!("--driver-root-mount={}", self.driver_root_mount),
        ];
        if self.multiuser {
            args.push("--multiuser".into());
        }
        if let Some(lib) = self.nvml_lib {
            args.push(format!("--nvml-lib={lib}"));
        }
        args
    }

    /// The daemon's container: the agent's image running [`SUBCOMMAND`], privileged, with the
    /// unit's directories and the driver root mounted.
    fn container(&self, dirs: &DaemonDirs) -> Container {
        let mut driver_mount = mount("driver-root", self.driver_root_mount, true);
        // The GPU operator's driver container may mount the driver after this pod starts.
        driver_mount.mount_propagation = Some("HostToContainer".into());
        Container {
            name: CONTAINER.into(),
            image: Some(self.agent.image.clone()),
            image_pull_policy: self.agent.image_pull_policy.clone(),
            args: Some(self.args()),
            env: Some(vec![k8s_openapi::api::core::v1::EnvVar {
                name: ENV_MPS_PIPE.into(),
                value: Some(dirs.pipe.clone()),
                ..Default::default()
            }]),
            resources: Some(ResourceRequirements {
                requests: Some(BTreeMap::from([
                    ("cpu".to_string(), Quantity("10m".into())),
                    ("memory".to_string(), Quantity("32Mi".into())),
                ])),
                ..Default::default()
            }),
            security_context: Some(SecurityContext {
                privileged: Some(true),
                run_as_user: Some(0),
                run_as_group: Some(0),
                read_only_root_filesystem: Some(true),
                ..Default::default()
            }),
            termination_message_policy: Some("FallbackToLogsOnError".into()),
            volume_mounts: Some(vec![
                mount("mps", &dirs.root, false),
                mount("shm", "/dev/shm", false),
                driver_mount,
            ]),
            ..Default::default()
        }
    }

    pub fn render(&self) -> Pod {
        let dirs = DaemonDirs::new(self.state_dir, self.unit);
        let labels = BTreeMap::from([
            ("app.kubernetes.io/name".to_string(), APP.to_string()),
            (
                "app.kubernetes.io/part-of".to_string(),
                "gpuplane".to_string(),
            ),
            (
                "app.kubernetes.io/component".to_string(),
                CONTAINER.to_string(),
            ),
        ]);
        let annotations = BTreeMap::from([(UNIT_ANNOTATION.to_string(), self.unit.to_string())]);
        let container = self.container(&dirs);
        Pod {
            metadata: ObjectMeta {
                name: Some(pod_name(self.node, self.unit)),
                namespace: Some(self.agent.namespace.clone()),
                labels: Some(labels),
                annotations: Some(annotations),
                owner_references: self.agent.owner.clone().map(|o| vec![o]),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some(self.node.into()),
                host_pid: Some(true),
                restart_policy: Some("Always".into()),
                automount_service_account_token: Some(false),
                enable_service_links: Some(false),
                priority_class_name: self.agent.priority_class_name.clone(),
                tolerations: (!self.agent.tolerations.is_empty())
                    .then(|| self.agent.tolerations.clone()),
                image_pull_secrets: (!self.agent.image_pull_secrets.is_empty()).then(|| {
                    self.agent
                        .image_pull_secrets
                        .iter()
                        .map(|n| LocalObjectReference { name: n.clone() })
                        .collect()
                }),
                termination_grace_period_seconds: Some(30),
                containers: vec![container],
                volumes: Some(vec![
                    host_path("mps", &dirs.root, "DirectoryOrCreate"),
                    host_path("shm", &dirs.shm, "DirectoryOrCreate"),
                    host_path("driver-root", self.driver_root, "Directory"),
                ]),
                ..Default::default()
            }),
            status: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent() -> AgentPod {
        AgentPod {
            namespace: "gpuplane-system".into(),
            image: "registry.example/gpuplane:1.2.3".into(),
            image_pull_policy: Some("IfNotPresent".into()),
            image_pull_secrets: vec!["regcred".into()],
            tolerations: vec![Toleration {
                key: Some("nvidia.com/gpu".into()),
                operator: Some("Exists".into()),
                effect: Some("NoSchedule".into()),
                ..Default::default()
            }],
            priority_class_name: Some("system-node-critical".into()),
            owner: Some(OwnerReference {
                api_version: "apps/v1".into(),
                kind: "DaemonSet".into(),
                name: "gpuplane-node".into(),
                uid: "ds-uid".into(),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn names_are_stable_per_node_and_unit_and_fit_any_node_name() {
        let a = pod_name("node-a", "GPU-1");
        assert_eq!(a, pod_name("node-a", "GPU-1"));
        assert_ne!(a, pod_name("node-b", "GPU-1"));
        assert_ne!(a, pod_name("node-a", "GPU-2"));
        assert_eq!(a.len(), APP.len() + 1 + 16);
        assert_eq!(pod_name(&"n".repeat(253), "GPU-1").len(), a.len());
    }

    #[test]
    fn the_pod_runs_beside_its_gpu_from_the_agents_build_with_the_units_directories() {
        let agent = agent();
        let pod = DaemonPod {
            node: "node-a",
            unit: "GPU-1",
            multiuser: true,
            agent: &agent,
            state_dir: "/var/lib/gpuplane/",
            driver_root: "/",
            driver_root_mount: "/host",
            nvml_lib: None,
        }
        .render();
        let spec = pod.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(spec.host_pid, Some(true));
        assert_eq!(spec.automount_service_account_token, Some(false));
        assert_eq!(spec.tolerations, Some(agent.tolerations.clone()));
        assert_eq!(
            spec.priority_class_name.as_deref(),
            Some("system-node-critical")
        );
        let c = &spec.containers[0];
        assert_eq!(c.image.as_deref(), Some("registry.example/gpuplane:1.2.3"));
        assert_eq!(
            c.args.as_ref().unwrap(),
            &vec![
                "mps-daemon".to_string(),
                "--unit=GPU-1".into(),
                "--state-dir=/var/lib/gpuplane/".into(),
                "--driver-root-mount=/host".into(),
                "--multiuser".into(),
            ]
        );
        let vols: Vec<(String, String)> = spec
            .volumes
            .iter()
            .flatten()
            .map(|v| (v.name.clone(), v.host_path.as_ref().unwrap().path.clone()))
            .collect();
        assert_eq!(
            vols,
            vec![
                ("mps".into(), "/var/lib/gpuplane/mps/GPU-1".to_string()),
                ("shm".into(), "/var/lib/gpuplane/mps/GPU-1/shm".into()),
                ("driver-root".into(), "/".into()),
            ]
        );
        let mounts: Vec<(&str, &str)> = c
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| (m.name.as_str(), m.mount_path.as_str()))
            .collect();
        assert_eq!(
            mounts,
            vec![
                ("mps", "/var/lib/gpuplane/mps/GPU-1"),
                ("shm", "/dev/shm"),
                ("driver-root", "/host")
            ]
        );
        let owner = &pod.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("DaemonSet", "ds-uid")
        );
        assert_eq!(
            pod.metadata.annotations.as_ref().unwrap()[UNIT_ANNOTATION],
            "GPU-1"
        );
    }

    #[test]
    fn the_agents_daemonset_becomes_a_plain_owner_not_a_controller() {
        let mut pod = Pod::default();
        pod.metadata.name = Some("gpuplane-node-x".into());
        pod.metadata.namespace = Some("gpuplane-system".into());
        pod.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "apps/v1".into(),
            kind: "DaemonSet".into(),
            name: "gpuplane-node".into(),
            uid: "u".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]);
        pod.spec = Some(PodSpec {
            containers: vec![Container {
                name: "agent".into(),
                image: Some("img".into()),
                ..Default::default()
            }],
            ..Default::default()
        });
        let a = AgentPod::from_pod(&pod, Some("agent")).unwrap();
        let o = a.owner.unwrap();
        assert_eq!((o.controller, o.block_owner_deletion), (None, None));
        assert_eq!(a.image, "img");
        let err = AgentPod::from_pod(&pod, Some("sidecar")).unwrap_err();
        assert!(err.contains("no container sidecar"), "{err}");
    }
}
