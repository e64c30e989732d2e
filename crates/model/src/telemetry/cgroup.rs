//! Which pod and container a process runs in, from its cgroup path (`/proc/<pid>/cgroup`).
//!
//! The kubelet puts each pod in a cgroup named after its UID and each container in a child
//! named after its runtime ID (kubelet `pkg/kubelet/cm`: `cgroup_manager_linux.go` and the
//! CRI runtimes' container cgroup naming):
//!
//! - cgroupfs driver: `…/kubepods/<qos>/pod<uid>/<container-id>`;
//! - systemd driver: `…/kubepods-<qos>-pod<uid with _ for ->.slice/cri-containerd-<id>.scope`
//!   (`crio-<id>.scope`, `docker-<id>.scope` for the other runtimes).
//!
//! Both the v1 (`N:controller:path`) and the v2 (`0::path`) line formats are read; the first line
//! naming a pod wins.

/// A process's pod UID and container runtime ID.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ContainerRef {
    pub pod_uid: String,
    pub container_id: String,
}

/// The pod and container in a `/proc/<pid>/cgroup` file's text; `None` for a process outside
/// any pod (the host's, the agent's own MPS server started outside Kubernetes).
pub fn container_of(cgroup_file: &str) -> Option<ContainerRef> {
    cgroup_file
        .lines()
        .filter_map(|line| line.splitn(3, ':').nth(2))
        .find_map(container_in_path)
}

fn container_in_path(path: &str) -> Option<ContainerRef> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let at = parts.iter().position(|p| pod_uid(p).is_some())?;
    let pod_uid = pod_uid(parts[at])?;
    let container_id = container_id(parts.get(at + 1)?)?;
    Some(ContainerRef {
        pod_uid,
        container_id,
    })
}

/// `pod<uid>` (cgroupfs) or `kubepods-<qos>-pod<uid_with_underscores>.slice` (systemd).
fn pod_uid(part: &str) -> Option<String> {
    let raw = match part.strip_suffix(".slice") {
        Some(unit) => unit.rsplit_once("-pod")?.1.replace('_', "-"),
        None => part.strip_prefix("pod")?.to_string(),
    };
    let is_uid = raw.len() == 36 && raw.chars().all(|c| c.is_ascii_hexdigit() || c == '-');
    is_uid.then_some(raw)
}

/// `<id>` (cgroupfs) or `<runtime>-<id>.scope` (systemd): the 64-hex-digit runtime ID.
fn container_id(part: &str) -> Option<String> {
    let id = match part.strip_suffix(".scope") {
        Some(unit) => unit.rsplit_once('-')?.1,
        None => part,
    };
    let is_id = id.len() == 64 && id.chars().all(|c| c.is_ascii_hexdigit());
    is_id.then(|| id.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f3c2a1e-5b6d-4c7e-8f90-a1b2c3d4e5f6";
    const ID: &str = "4b1d8e0f4b1d8e0f4b1d8e0f4b1d8e0f4b1d8e0f4b1d8e0f4b1d8e0f4b1d8e0f";

    fn expected() -> Option<ContainerRef> {
        Some(ContainerRef {
            pod_uid: UID.into(),
            container_id: ID.into(),
        })
    }

    #[test]
    fn cgroupfs_and_systemd_paths_name_the_pod_and_container() {
        let cgroupfs = format!("0::/kubepods/besteffort/pod{UID}/{ID}\n");
        assert_eq!(container_of(&cgroupfs), expected());
        let systemd = format!(
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{ID}.scope\n",
            UID.replace('-', "_")
        );
        assert_eq!(container_of(&systemd), expected());
        let guaranteed_v1 =
            format!("12:memory:/kubepods/pod{UID}/{ID}\n11:cpu:/kubepods/pod{UID}/{ID}\n");
        assert_eq!(container_of(&guaranteed_v1), expected());
    }

    #[test]
    fn processes_outside_pods_and_pod_level_cgroups_name_no_container() {
        assert_eq!(
            container_of("0::/system.slice/nvidia-persistenced.service\n"),
            None
        );
        assert_eq!(
            container_of(&format!("0::/kubepods/besteffort/pod{UID}\n")),
            None
        );
        assert_eq!(container_of("garbage"), None);
        assert_eq!(container_of(""), None);
    }
}
