//! `--simulate-telemetry FILE`: what a simulated machine's devices are doing, read from a
//! telemetry file (the format the fake libnvidia-ml reads, `gpuplane_model::sim::telemetry`)
//! whenever it changes, so the telemetry, attribution and idle Events of a simulated node can be
//! driven from outside the agent: a deployed lab, a demo. A missing file reads as every device
//! idle; one that does not parse keeps the readings before it and is logged once per change.

use gpuplane_model::sim::telemetry::{parse, TelemetryFile};
use gpuplane_model::source::SimSource;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

/// How often the file's metadata is looked at.
pub const EVERY: Duration = Duration::from_secs(1);

/// What tells a changed file: modification time, size, inode.
type Stamp = Option<(Option<SystemTime>, u64, u64)>;

fn stamp(path: &std::path::Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok(), m.len(), m.ino()))
}

/// Reads `path` into `sim` now and then on every change, on a thread of its own for the
/// process's life.
pub fn follow(sim: SimSource, path: PathBuf) -> std::io::Result<()> {
    let mut seen: Stamp = None;
    load(&sim, &path, &mut seen);
    std::thread::Builder::new()
        .name("sim-telemetry".into())
        .spawn(move || loop {
            std::thread::sleep(EVERY);
            load(&sim, &path, &mut seen);
        })
        .map(|_| ())
}

fn load(sim: &SimSource, path: &std::path::Path, seen: &mut Stamp) {
    let now = stamp(path);
    if now == *seen && seen.is_some() {
        return;
    }
    *seen = now;
    let label = path.display().to_string();
    let read = match std::fs::read_to_string(path) {
        Ok(text) => parse(&label, &text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(TelemetryFile::default()),
        Err(e) => Err(format!("telemetry file {label}: {e}")),
    };
    match read {
        Ok(file) => sim.set_telemetry(file),
        Err(e) => {
            tracing::warn!(error = %e, "simulated telemetry not changed; fix the file")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuplane_model::source::DeviceSource;

    #[test]
    fn the_file_is_read_on_each_change_and_a_broken_one_keeps_the_last_readings() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.json");
        let sim = SimSource::new(gpuplane_model::sim::load("pcie-l4x4").unwrap());
        let uuid = sim.discover().unwrap().inventory.gpus[0].uuid.clone();
        let util = |sim: &SimSource| sim.sample(&uuid).unwrap().gpu_util_percent;
        let mut seen = None;
        load(&sim, &path, &mut seen);
        assert_eq!(util(&sim), Some(0), "missing: idle");
        std::fs::write(
            &path,
            format!(r#"{{"devices": {{"{uuid}": {{"gpuUtil": 70}}}}}}"#),
        )
        .unwrap();
        load(&sim, &path, &mut seen);
        assert_eq!(util(&sim), Some(70));
        std::fs::write(&path, "{not json").unwrap();
        load(&sim, &path, &mut seen);
        assert_eq!(
            util(&sim),
            Some(70),
            "a broken file keeps the last readings"
        );
    }
}
