//! Prometheus counters of the webhook (text exposition format).

use super::review::Verdict;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

#[derive(Debug, Default)]
pub struct Metrics {
    /// (webhook, result) -> count.
    admissions: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    /// HTTP answers other than an AdmissionReview, by status code.
    rejected_bodies: Mutex<BTreeMap<u16, u64>>,
    contended: Mutex<u64>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Metrics {
    pub fn admission(&self, webhook: &'static str, v: &Verdict) {
        let result = match (v.allowed, v.patch.is_empty(), v.code) {
            (true, true, _) => "allowed",
            (true, false, _) => "patched",
            (false, _, 403) => "denied",
            (false, _, 400) => "bad_request",
            (false, _, _) => "error",
        };
        *lock(&self.admissions).entry((webhook, result)).or_default() += 1;
    }

    pub fn rejected_body(&self, code: u16) {
        *lock(&self.rejected_bodies).entry(code).or_default() += 1;
    }

    pub fn contended(&self) {
        *lock(&self.contended) += 1;
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# HELP gpuplane_webhook_admissions_total Admission requests answered, by webhook and result.");
        let _ = writeln!(s, "# TYPE gpuplane_webhook_admissions_total counter");
        for ((w, r), n) in lock(&self.admissions).iter() {
            let _ = writeln!(
                s,
                "gpuplane_webhook_admissions_total{{webhook=\"{w}\",result=\"{r}\"}} {n}"
            );
        }
        let _ = writeln!(s, "# HELP gpuplane_webhook_rejected_bodies_total Request bodies answered with an HTTP error, by code.");
        let _ = writeln!(s, "# TYPE gpuplane_webhook_rejected_bodies_total counter");
        for (c, n) in lock(&self.rejected_bodies).iter() {
            let _ = writeln!(
                s,
                "gpuplane_webhook_rejected_bodies_total{{code=\"{c}\"}} {n}"
            );
        }
        let _ = writeln!(s, "# HELP gpuplane_webhook_reservation_contended_total Reservations given up after too many write conflicts.");
        let _ = writeln!(
            s,
            "# TYPE gpuplane_webhook_reservation_contended_total counter"
        );
        let _ = writeln!(
            s,
            "gpuplane_webhook_reservation_contended_total {}",
            *lock(&self.contended)
        );
        // The quota queue's counters, when the controller runs in this process (zero otherwise).
        s.push_str(&crate::controller::metrics::QueueMetrics::process().render());
        s
    }
}
