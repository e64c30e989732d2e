//! The driver-install scan, once per driver root and driver version.
//!
//! [`super::driver::scan_install`] lists library directories under the driver root; its result depends
//! only on that root and the driver version (a driver upgrade changes the version the
//! inventory reports, and with it the key). Device nodes are not cached: they can appear or go
//! without the version changing (#1380), so callers still check them per spec, which costs
//! `lstat`s only.

use super::{DriverFiles, DriverInstall, ProcCaps};
use crate::inventory::Inventory;
use crate::paths::HostPaths;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The last scan, keyed by what determines it. Shared by everyone rendering specs for one
/// driver root.
#[derive(Debug, Default)]
pub struct InstallCache {
    last: Mutex<Option<Entry>>,
    scans: AtomicU64,
}

#[derive(Debug)]
struct Entry {
    root: PathBuf,
    driver_version: String,
    install: Arc<DriverInstall>,
}

impl InstallCache {
    /// The install under `root` for `driver_version`, scanning only when either differs from
    /// the last call's. Blocks on file-system reads: call it off the async runtime.
    pub fn get(&self, root: &Path, driver_version: &str) -> Arc<DriverInstall> {
        // Held across the scan, so concurrent callers for a new version scan once. A poisoned
        // lock only means a panic mid-scan; the entry is replaced whole, so it is still good.
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = last.as_ref() {
            if e.root == root && e.driver_version == driver_version {
                return e.install.clone();
            }
        }
        let install = Arc::new(super::driver::scan_install(root, driver_version));
        self.scans.fetch_add(1, Ordering::Relaxed);
        *last = Some(Entry {
            root: root.to_path_buf(),
            driver_version: driver_version.to_string(),
            install: install.clone(),
        });
        install
    }

    /// The driver files for `inv` on the host `paths` names: device nodes (and their numbers
    /// in `/proc`) checked now, the install from this cache. What the node spec and every
    /// claim's spec are rendered from.
    pub fn discover(&self, paths: &HostPaths, inv: &Inventory) -> DriverFiles {
        let proc = ProcCaps::new(&paths.proc_root);
        let install = self.get(paths.driver_files(), &inv.driver_version);
        super::driver::discover_nodes_with(
            &paths.driver_root,
            paths.driver_root_mount.as_deref(),
            &paths.dev_root,
            inv,
            &proc,
            &install,
        )
    }

    /// How many scans ran (for tests and logs).
    pub fn scans(&self) -> u64 {
        self.scans.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn scans_once_per_root_and_driver_version() {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("usr/lib64");
        fs::create_dir_all(&lib).unwrap();
        fs::write(lib.join("libcuda.so.550.54.15"), b"").unwrap();
        let cache = InstallCache::default();
        let first = cache.get(dir.path(), "550.54.15");
        assert_eq!(first.libraries.len(), 1);
        // A file added behind its back is not seen until the version changes: no rescan.
        fs::write(lib.join("libnvidia-ml.so.550.54.15"), b"").unwrap();
        fs::write(lib.join("libcuda.so.560.28.03"), b"").unwrap();
        assert_eq!(cache.get(dir.path(), "550.54.15"), first);
        assert_eq!(cache.scans(), 1);
        let upgraded = cache.get(dir.path(), "560.28.03");
        assert_eq!(cache.scans(), 2);
        assert!(upgraded
            .libraries
            .iter()
            .any(|l| l.host_path.ends_with("libcuda.so.560.28.03")));
        let other = tempfile::tempdir().unwrap();
        assert!(cache.get(other.path(), "560.28.03").libraries.is_empty());
        assert_eq!(cache.scans(), 3);
    }
}
