//! The usage rounds: every sampling interval the attributed readings become each hold's use
//! (`idle::held_uses`), which feeds the busy counters (`gpuplane_container_gpu_busy_seconds_total`)
//! and, with `--idle-after`, the pure [`IdleBook`]: how long each hold has been idle is kept for
//! `/metrics`, and a hold idle for the whole window gets its one Event.

use super::attribute::{DeviceLabels, Hold};
use super::busy::BusyCounters;
use super::idle::{held_uses, idle_note, IdleBook, IdlePolicy};
use super::idle_events::{post, IdleEvents};
use super::Telemetry;
use crate::state::NodeState;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Follows the holds' use every `interval` until `shutdown`; idleness only with a `policy`.
pub async fn watch(
    telemetry: Arc<Telemetry>,
    state: Arc<NodeState>,
    policy: Option<IdlePolicy>,
    events: Option<IdleEvents>,
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut busy = BusyCounters::default();
    let mut book = IdleBook::default();
    let mut tick = tokio::time::interval(interval);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        let uses = held_uses(&telemetry.attributed(&state));
        let now = Instant::now();
        busy.observe(&uses, now);
        telemetry.set_busy(busy.totals());
        let Some(policy) = &policy else {
            continue;
        };
        let round = book.observe(&uses, policy, now);
        let idle: Vec<(DeviceLabels, Hold, f64)> = round
            .idle_for
            .iter()
            .map(|(u, d)| (u.device.clone(), u.holder.clone(), d.as_secs_f64()))
            .collect();
        telemetry.set_idle(idle);
        for (u, idle_for) in &round.newly_idle {
            tracing::info!(device = %u.device.uuid, namespace = %u.holder.namespace, pod = %u.holder.pod,
                note = %idle_note(u, *idle_for), "held device idle");
            if let Some(events) = &events {
                post(events, &telemetry.pods, u, *idle_for).await;
            }
        }
    }
}
