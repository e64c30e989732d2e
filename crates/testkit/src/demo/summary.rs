//! The demo's steps and how each one ended (pure): names, outcomes, and the summary rendered as
//! a table for people and as JSON for scripts. An outcome is only ever built from what a step
//! observed; this module just lays them out.

use serde_json::{json, Value};
use std::time::Duration;

/// The steps of the story, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Inventory,
    NvlinkAllocation,
    Telemetry,
    DraClaim,
    LedgerRefusal,
    Quota,
    PodGroup,
    XidHealth,
    GpuShare,
    DynamicMig,
    WhyPending,
    Preemption,
    GpuHours,
}

impl Step {
    pub const ALL: [Step; 13] = [
        Step::Inventory,
        Step::NvlinkAllocation,
        Step::Telemetry,
        Step::DraClaim,
        Step::LedgerRefusal,
        Step::Quota,
        Step::PodGroup,
        Step::XidHealth,
        Step::GpuShare,
        Step::DynamicMig,
        Step::WhyPending,
        Step::Preemption,
        Step::GpuHours,
    ];

    /// 1-based position in the story.
    pub fn number(self) -> usize {
        Step::ALL
            .iter()
            .position(|s| *s == self)
            .map_or(0, |i| i + 1)
    }

    /// A stable name, for the summary and scripts.
    pub fn key(self) -> &'static str {
        match self {
            Step::Inventory => "inventory",
            Step::NvlinkAllocation => "nvlink-allocation",
            Step::DraClaim => "dra-claim",
            Step::LedgerRefusal => "ledger-refusal",
            Step::Quota => "quota",
            Step::PodGroup => "pod-group",
            Step::XidHealth => "xid-health",
            Step::GpuShare => "gpu-share",
            Step::DynamicMig => "dynamic-mig",
            Step::WhyPending => "why-pending",
            Step::Preemption => "preemption",
            Step::GpuHours => "gpu-hours",
            Step::Telemetry => "telemetry",
        }
    }

    /// The heading of the step in the narrative.
    pub fn title(self) -> &'static str {
        match self {
            Step::Inventory => "The inventory and its topology",
            Step::NvlinkAllocation => "A 4-GPU device-plugin request gets an NVLink-optimal set",
            Step::DraClaim => "A ResourceClaim is prepared through DRA, with its CDI spec",
            Step::LedgerRefusal => "The same device is refused to the other API",
            Step::Quota => "A GpuQuota admits one pod and denies another",
            Step::PodGroup => "A pod group is released all at once",
            Step::XidHealth => "An Xid turns a device unhealthy, and it recovers",
            Step::GpuShare => {
                "A fractional GPU share is prepared and charged to quota on the same numbers"
            }
            Step::DynamicMig => "A MIG instance is made for a claim, and destroyed when it ends",
            Step::WhyPending => "Why a fragmented request is Pending",
            Step::Preemption => "A high-priority pod preempts a lower-priority one under its quota",
            Step::GpuHours => "The GPU-hours report",
            Step::Telemetry => "What each held GPU does, for the pod that holds it",
        }
    }
}

/// How a step ended, with the evidence (held), the reason (failed) or why the machine cannot
/// show it (skipped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Held(String),
    Failed(String),
    Skipped(String),
}

impl Outcome {
    /// The word the summary shows.
    pub fn word(&self) -> &'static str {
        match self {
            Outcome::Held(_) => "held",
            Outcome::Failed(_) => "FAILED",
            Outcome::Skipped(_) => "skipped",
        }
    }

    pub fn detail(&self) -> &str {
        match self {
            Outcome::Held(d) | Outcome::Failed(d) | Outcome::Skipped(d) => d,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepResult {
    pub step: Step,
    pub outcome: Outcome,
}

/// Everything the demo found out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// The profile as given (bundled name or file).
    pub profile: String,
    pub results: Vec<StepResult>,
    pub elapsed: Duration,
    /// What went wrong stopping the pieces and removing the working dir; a demo that cannot
    /// shut down cleanly does not pass.
    pub shutdown: Vec<String>,
}

impl Summary {
    /// The steps that did not hold.
    pub fn failed(&self) -> Vec<Step> {
        self.results
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::Failed(_)))
            .map(|r| r.step)
            .collect()
    }

    /// Every step held or was skipped, and everything shut down cleanly.
    pub fn ok(&self) -> bool {
        self.failed().is_empty() && self.shutdown.is_empty()
    }

    fn count(&self, word: &str) -> usize {
        self.results
            .iter()
            .filter(|r| r.outcome.word() == word)
            .count()
    }

    /// The closing line: how many held, were skipped and failed, naming the failures.
    pub fn verdict(&self) -> String {
        let (held, skipped) = (self.count("held"), self.count("skipped"));
        let failed = self.failed();
        if failed.is_empty() && !self.shutdown.is_empty() {
            return format!(
                "The steps held, but shutting down failed: {}",
                self.shutdown.join("; ")
            );
        }
        if !failed.is_empty() {
            let names: Vec<&str> = failed.iter().map(|s| s.key()).collect();
            return format!(
                "{} of {} steps did not hold: {}",
                failed.len(),
                self.results.len(),
                names.join(", ")
            );
        }
        match skipped {
            0 => format!("All {held} steps held."),
            _ => format!(
                "{held} steps held, {skipped} skipped (the machine cannot show them); none failed."
            ),
        }
    }

    /// The summary table: one row per step with its number, key, result and evidence.
    pub fn render_table(&self) -> String {
        let width = self
            .results
            .iter()
            .map(|r| r.step.key().len())
            .max()
            .unwrap_or(0)
            .max("STEP".len());
        let mut out = format!(
            "Summary ({}, {:.1} s)\n   #  {:<width$}  {:<7}  EVIDENCE\n",
            self.profile,
            self.elapsed.as_secs_f64(),
            "STEP",
            "RESULT"
        );
        for r in &self.results {
            out.push_str(&format!(
                "  {:>2}  {:<width$}  {:<7}  {}\n",
                r.step.number(),
                r.step.key(),
                r.outcome.word(),
                r.outcome.detail()
            ));
        }
        out.push_str(&self.verdict());
        out.push('\n');
        out
    }

    /// The summary for scripts: `{profile, elapsedSeconds, ok, steps[{number, key, title,
    /// result, detail}]}` with `result` one of `held`, `failed`, `skipped`.
    pub fn to_json(&self) -> Value {
        let steps: Vec<Value> = self
            .results
            .iter()
            .map(|r| {
                json!({
                    "number": r.step.number(),
                    "key": r.step.key(),
                    "title": r.step.title(),
                    "result": r.outcome.word().to_ascii_lowercase(),
                    "detail": r.outcome.detail(),
                })
            })
            .collect();
        json!({
            "profile": self.profile,
            "elapsedSeconds": self.elapsed.as_secs_f64(),
            "ok": self.ok(),
            "steps": steps,
            "shutdown": self.shutdown,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(outcomes: Vec<Outcome>) -> Summary {
        Summary {
            profile: "dgx-h100".into(),
            results: Step::ALL
                .iter()
                .zip(outcomes)
                .map(|(s, o)| StepResult {
                    step: *s,
                    outcome: o,
                })
                .collect(),
            elapsed: Duration::from_millis(4200),
            shutdown: Vec::new(),
        }
    }

    #[test]
    fn steps_are_numbered_in_story_order_with_distinct_keys() {
        let numbers: Vec<usize> = Step::ALL.iter().map(|s| s.number()).collect();
        assert_eq!(numbers, (1..=13).collect::<Vec<_>>());
        let mut keys: Vec<&str> = Step::ALL.iter().map(|s| s.key()).collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), 13);
    }

    #[test]
    fn the_table_has_one_aligned_row_per_step_and_says_all_held() {
        let s = summary((0..13).map(|i| Outcome::Held(format!("ev {i}"))).collect());
        let table = s.render_table();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[0], "Summary (dgx-h100, 4.2 s)");
        assert_eq!(lines[1], "   #  STEP               RESULT   EVIDENCE");
        assert_eq!(lines[2], "   1  inventory          held     ev 0");
        assert_eq!(lines[4], "   3  telemetry          held     ev 2");
        assert_eq!(lines[9], "   8  xid-health         held     ev 7");
        assert_eq!(lines[14], "  13  gpu-hours          held     ev 12");
        assert_eq!(lines[15], "All 13 steps held.");
        assert!(s.ok());
    }

    #[test]
    fn a_failed_shutdown_fails_the_run_even_when_every_step_held() {
        let mut s = summary((0..13).map(|_| Outcome::Held("ok".into())).collect());
        s.shutdown.push("node agent: socket left behind".into());
        assert!(!s.ok());
        assert!(s.failed().is_empty());
        assert_eq!(
            s.verdict(),
            "The steps held, but shutting down failed: node agent: socket left behind"
        );
        assert_eq!(s.to_json()["ok"], false);
    }

    #[test]
    fn skipped_steps_are_not_failures_and_failures_are_named() {
        let mut outcomes: Vec<Outcome> = (0..13).map(|_| Outcome::Held("ok".into())).collect();
        outcomes[1] = Outcome::Skipped("no NVLink".into());
        let s = summary(outcomes.clone());
        assert!(s.failed().is_empty());
        assert_eq!(
            s.verdict(),
            "12 steps held, 1 skipped (the machine cannot show them); none failed."
        );
        assert!(s
            .render_table()
            .contains("   2  nvlink-allocation  skipped  no NVLink\n"));

        outcomes[4] = Outcome::Failed("Allocate was granted".into());
        let s = summary(outcomes);
        assert_eq!(s.failed(), [Step::LedgerRefusal]);
        assert_eq!(s.verdict(), "1 of 13 steps did not hold: ledger-refusal");
        assert!(s
            .render_table()
            .contains("   5  ledger-refusal     FAILED   Allocate was granted\n"));
    }

    #[test]
    fn json_carries_every_step_and_whether_the_run_held() {
        let mut outcomes: Vec<Outcome> = (0..13).map(|_| Outcome::Held("ok".into())).collect();
        outcomes[7] = Outcome::Failed("no taint".into());
        let v = summary(outcomes).to_json();
        assert_eq!(v["ok"], false);
        assert_eq!(v["profile"], "dgx-h100");
        assert_eq!(v["steps"].as_array().map(Vec::len), Some(13));
        assert_eq!(v["steps"][7]["key"], "xid-health");
        assert_eq!(v["steps"][7]["result"], "failed");
        assert_eq!(v["steps"][0]["result"], "held");
    }
}
