//! `gpuplane demo` as a user runs it: the real binary to completion, its summary read back
//! row by row (each step by name, with its evidence), on the default machine, on one with GPUs
//! for dynamic MIG and on ones that cannot show every step; and a profile that does not exist.

use std::collections::BTreeMap;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const STEPS: [&str; 13] = [
    "inventory",
    "nvlink-allocation",
    "telemetry",
    "dra-claim",
    "ledger-refusal",
    "quota",
    "pod-group",
    "xid-health",
    "gpu-share",
    "dynamic-mig",
    "why-pending",
    "preemption",
    "gpu-hours",
];

/// Steps the default machine (dgx-h100) cannot show, with the reason they give.
const SKIPPED_ON_DGX_H100: [(&str, &str); 1] =
    [("dynamic-mig", "no GPU in MIG mode without instances")];

/// What each new step's evidence must say, from the answers it got.
fn new_steps_evidence(rows: &BTreeMap<String, (usize, String, String)>, stdout: &str) {
    let ev = |key: &str| -> &str {
        let (_, result, evidence) = &rows[key];
        assert_eq!(result, "held", "{key}: {evidence}\n{stdout}");
        evidence
    };
    // The quota card: the share's own figures in its CDI spec and in the quota's charge.
    let share = ev("gpu-share");
    for want in [
        "GPUPLANE_SHARE_MEMORY=15Gi",
        "GPUPLANE_SHARE_COMPUTE=80",
        "used gpuMemory 15Gi, gpus 4/5",
        "gpuMemory: requested 10Gi, used 15Gi of 20Gi",
        "gpus: requested 1/2, used 4/5 of 1",
    ] {
        assert!(share.contains(want), "gpu-share lacks {want:?}: {share}");
    }
    let pending = ev("why-pending");
    assert!(
        pending.starts_with("Fragmentation: needs ")
            && pending.contains("node-b 2, node-c 2")
            && pending.contains(" free across "),
        "{pending}"
    );
    let preemption = ev("preemption");
    assert!(
        preemption.contains("batch (priority 10) evicted through the Eviction API")
            && preemption.contains("infer (priority 1000) gated until it was gone, then released"),
        "{preemption}"
    );
    assert!(
        stdout.contains("1 x POST pods/batch/eviction, 0 x DELETE"),
        "{stdout}"
    );
    let hours = ev("gpu-hours");
    assert!(
        hours.contains("team-h: 3.000 GPU-hours = 2 GPUs x 1.5 h"),
        "{hours}"
    );
    // Telemetry: each reading on the pod holding the GPU, an unheld GPU still reporting.
    let telemetry = ev("telemetry");
    assert!(
        telemetry.contains("85% busy")
            && telemetry.contains("on demo/train-4gpu/main via device-plugin")
            && telemetry.contains("an unheld GPU reports with no holder"),
        "{telemetry}"
    );
}

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
    // Rows are indented; the verdict below them is not.
    for line in table.lines().skip(2).filter(|l| l.starts_with(' ')) {
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
        match SKIPPED_ON_DGX_H100.iter().find(|(k, _)| k == key) {
            Some((_, why)) => assert!(
                result == "skipped" && evidence.contains(why),
                "{key}: {result} {evidence}"
            ),
            None => assert_eq!(result, "held", "{key}: {evidence}\n{stdout}"),
        }
        assert!(!evidence.is_empty(), "{key} gives no evidence");
    }
    assert_eq!(rows.len(), STEPS.len(), "{rows:?}");
    assert!(
        stdout
            .contains("\n12 steps held, 1 skipped (the machine cannot show them); none failed.\n"),
        "{stdout}"
    );
    new_steps_evidence(&rows, &stdout);
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
fn a_machine_with_gpus_in_mig_mode_shows_a_dynamic_mig_instance_made_and_destroyed() {
    let (out, _) = demo(&["--profile", "dynamic-mig-mixed"]);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{}",
        out.status,
        text(&out.stderr)
    );
    let rows = summary(&stdout);
    for key in STEPS {
        let (_, result, evidence) = &rows[key];
        // One whole GPU as nvidia.com/gpu: no 4-GPU set, no pod with two GPUs to watch.
        let want = if key == "nvlink-allocation" || key == "telemetry" {
            "skipped"
        } else {
            "held"
        };
        assert_eq!(result, want, "{key}: {evidence}\n{stdout}");
    }
    let (_, _, evidence) = &rows["dynamic-mig"];
    assert!(
        evidence.contains("MIG instance 3g.40gb at slice 4 made at NodePrepare (MIG-")
            && evidence.ends_with("destroyed at NodeUnprepare"),
        "{evidence}"
    );
    assert!(
        stdout.contains("NodeUnprepareResources -> 0 MIG instance(s) left"),
        "{stdout}"
    );
}

#[test]
fn machines_that_cannot_show_a_step_skip_it_with_the_reason_and_still_pass() {
    let dynamic = ("dynamic-mig", "no GPU in MIG mode without instances");
    let one_gpu = [
        ("nvlink-allocation", "1 whole GPU(s)"),
        ("telemetry", "cannot give one pod 2 whole GPUs"),
        dynamic,
    ];
    for (profile, skipped, verdict) in [
        (
            "pcie-l4x4",
            &[("nvlink-allocation", "no NVLink"), dynamic][..],
            "11 steps held, 2 skipped",
        ),
        ("a100-mig-mixed", &one_gpu[..], "10 steps held, 3 skipped"),
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
            match skipped.iter().find(|(k, _)| *k == key) {
                Some((_, why)) => {
                    assert_eq!(result, "skipped", "{profile} {key}");
                    assert!(evidence.contains(why), "{profile}: {evidence}");
                }
                None => assert_eq!(result, "held", "{profile} {key}: {evidence}\n{stdout}"),
            }
        }
        assert!(stdout.contains(verdict), "{profile}: {stdout}");
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
    for s in v["steps"].as_array().unwrap() {
        let want = if s["key"] == "dynamic-mig" {
            "skipped"
        } else {
            "held"
        };
        assert_eq!(s["result"], want, "{s}");
        assert!(s["detail"].as_str().is_some_and(|d| !d.is_empty()), "{s}");
    }
    // The new steps' evidence is in the JSON too.
    let detail = |key: &str| {
        v["steps"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["key"] == key)
            .and_then(|s| s["detail"].as_str())
            .unwrap_or_default()
            .to_string()
    };
    assert!(
        detail("gpu-share").contains("used gpuMemory 15Gi, gpus 4/5"),
        "{v}"
    );
    assert!(detail("why-pending").starts_with("Fragmentation: "), "{v}");
    assert!(detail("preemption").contains("Eviction API"), "{v}");
    assert!(detail("gpu-hours").contains("3.000 GPU-hours"), "{v}");
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
