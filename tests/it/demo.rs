//! `gpuplane demo` as a user runs it: the real binary to completion, its summary read back
//! row by row, on the default machine and on ones that cannot show every step; and a profile
//! that does not exist.

use std::collections::BTreeMap;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const STEPS: [&str; 7] = [
    "inventory",
    "nvlink-allocation",
    "dra-claim",
    "ledger-refusal",
    "quota",
    "pod-group",
    "xid-health",
];

fn demo(args: &[&str]) -> (Output, Duration) {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_gpuplane"))
        .arg("demo")
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run gpuplane demo");
    (out, start.elapsed())
}

/// The summary's rows: step key -> (number, result, evidence).
fn summary(stdout: &str) -> BTreeMap<String, (usize, String, String)> {
    let table = stdout
        .split_once("\nSummary (")
        .unwrap_or_else(|| panic!("no summary in:\n{stdout}"))
        .1;
    let mut rows = BTreeMap::new();
    for line in table.lines().skip(2) {
        let mut parts = line.split_whitespace();
        let (Some(n), Some(key), Some(result)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let Ok(n) = n.parse::<usize>() else { continue };
        rows.insert(
            key.to_string(),
            (n, result.to_string(), parts.collect::<Vec<_>>().join(" ")),
        );
    }
    rows
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn the_demo_runs_to_completion_in_seconds_and_every_step_holds() {
    let (out, took) = demo(&[]);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "exit {:?}\nstdout:\n{stdout}\nstderr:\n{}",
        out.status,
        text(&out.stderr)
    );
    let rows = summary(&stdout);
    for (i, key) in STEPS.iter().enumerate() {
        let (n, result, evidence) = rows
            .get(*key)
            .unwrap_or_else(|| panic!("no row for {key} in:\n{stdout}"));
        assert_eq!(*n, i + 1, "{key}");
        assert_eq!(result, "held", "{key}: {evidence}\n{stdout}");
        assert!(!evidence.is_empty(), "{key} gives no evidence");
    }
    assert_eq!(rows.len(), STEPS.len(), "{rows:?}");
    assert!(stdout.contains("\nAll 7 steps held.\n"), "{stdout}");
    // The evidence comes from the answers: the machine's facts and the real refusals.
    assert!(
        rows["inventory"].2.contains("all 8 units") && rows["inventory"].2.contains("NVSwitch"),
        "{:?}",
        rows["inventory"]
    );
    assert!(stdout.contains("gpus: requested 1, used 2 of 2 in GpuQuota team-a/default"));
    assert!(stdout.contains("is held by ResourceClaim demo/inference"));
    assert!(stdout.contains(".json: devices "), "the CDI spec is shown");
    // Its temp dir is gone.
    let dir = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("working dir "))
        .and_then(|l| l.split_whitespace().next())
        .expect("the working dir is named");
    assert!(!std::path::Path::new(dir).exists(), "{dir} left behind");
    // Quiet: the story is on stdout, no log lines on stderr by default.
    assert_eq!(text(&out.stderr), "");
    assert!(took < Duration::from_secs(60), "took {took:?}");
}

#[test]
fn machines_that_cannot_show_a_step_skip_it_with_the_reason_and_still_pass() {
    for (profile, skipped, why) in [
        ("pcie-l4x4", "nvlink-allocation", "no NVLink"),
        ("a100-mig-mixed", "nvlink-allocation", "1 whole GPU(s)"),
    ] {
        let (out, _) = demo(&["--profile", profile]);
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "{profile}: exit {:?}\n{stdout}\n{}",
            out.status,
            text(&out.stderr)
        );
        let rows = summary(&stdout);
        for key in STEPS {
            let (_, result, evidence) = &rows[key];
            if key == skipped {
                assert_eq!(result, "skipped", "{profile} {key}");
                assert!(evidence.contains(why), "{profile}: {evidence}");
            } else {
                assert_eq!(result, "held", "{profile} {key}: {evidence}\n{stdout}");
            }
        }
        assert!(
            stdout.contains("6 steps held, 1 skipped"),
            "{profile}: {stdout}"
        );
    }
}

#[test]
fn json_output_carries_the_summary_alone_on_stdout() {
    let (out, _) = demo(&["--profile", "dgx1-v100", "-o", "json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", text(&out.stdout)));
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["profile"], "dgx1-v100");
    let keys: Vec<&str> = v["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, STEPS);
    assert!(v["steps"]
        .as_array()
        .unwrap()
        .iter()
        .all(|s| s["result"] == "held"));
    // The narrative went to stderr.
    assert!(text(&out.stderr).contains("1. The inventory and its topology"));
}

#[test]
fn a_bad_profile_is_a_clear_error_and_a_failing_exit() {
    let (out, _) = demo(&["--profile", "no-such-machine"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.starts_with("error: "), "{err}");
    assert!(err.contains("no-such-machine"), "{err}");
    assert!(out.stdout.is_empty(), "nothing ran: {}", text(&out.stdout));

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("broken.yaml");
    std::fs::write(&file, "gpus: [}\n").unwrap();
    let (out, _) = demo(&["--profile", file.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("broken.yaml"), "{err}");
}
