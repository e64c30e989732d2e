//! The processes the bench weighs, read from /proc: CPU seconds (utime + stime) and peak
//! resident memory (VmHWM), and the control plane's processes found by name inside the lab's
//! network namespace (other labs on the machine run processes of the same names).

use std::path::Path;

/// Clock ticks per second of /proc/<pid>/stat (USER_HZ; 100 on Linux x86_64).
const TICKS: f64 = 100.0;

/// CPU seconds `pid` used so far (user + system), 0 when it is gone.
pub fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name (field 2) may hold spaces; fields after its closing parenthesis.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    // utime and stime are fields 14 and 15, i.e. 12 and 13 after the name.
    (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) / TICKS
}

/// A field of /proc/<pid>/status in MiB (VmHWM: peak RSS, VmRSS: now).
pub fn mem_mib(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

/// The pid of the process named `comm` in the network namespace of `init`.
pub fn in_lab(init: u32, comm: &str) -> Option<u32> {
    let netns = std::fs::read_link(format!("/proc/{init}/ns/net")).ok()?;
    std::fs::read_dir("/proc").ok()?.find_map(|e| {
        let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let dir = Path::new("/proc").join(pid.to_string());
        let name = std::fs::read_to_string(dir.join("comm")).ok()?;
        (name.trim() == comm && std::fs::read_link(dir.join("ns/net")).ok()? == netns)
            .then_some(pid)
    })
}
