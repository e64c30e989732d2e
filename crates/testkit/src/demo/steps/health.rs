//! Step 7: an Xid through the driver's event stream. The device must turn unhealthy in both
//! APIs (a ResourceSlice taint, ListAndWatch, the DRA health stream) and recover in both after
//! the quiet period, not before.

use super::{list, listed, poll, published, Carry, Context};
use crate::demo::summary::Outcome;
use crate::demo::{Narrator, RECOVERY_QUIET_PERIOD};
use crate::doubles::lab::{DRIVER, NODE};
use gpuplane_model::inventory::DeviceRef;
use gpuplane_node::proto::dra_health_v1::HealthStatus;
use gpuplane_node::slices::render::UNHEALTHY_TAINT_KEY;
use std::time::Instant;

/// A critical Xid (double-bit ECC error): not on NVIDIA's list of application-caused ones.
const XID: u64 = 48;

/// A device's health as each API shows it: its unhealthy taints, ListAndWatch's word, and the
/// DRA health stream's status.
type Seen = (Vec<String>, String, Option<HealthStatus>);

pub(super) async fn run(cx: &Context<'_>, carry: &mut Carry, say: &mut Narrator<'_>) -> Outcome {
    let (device, uuid) = match target(cx, carry).await {
        Ok(t) => t,
        Err(e) => return Outcome::Failed(e),
    };
    let (gpu_uuid, mig_uuid) = match cx.inventory.dra_device(&device) {
        Some(DeviceRef::Gpu(g)) => (g.uuid.clone(), None),
        Some(DeviceRef::Mig { parent, mig }) => (parent.uuid.clone(), Some(mig.uuid.clone())),
        None => return Outcome::Failed(format!("{device} is not in the inventory")),
    };
    let injected = Instant::now();
    cx.lab.sim.inject_xid(&gpu_uuid, mig_uuid.as_ref(), XID);
    say.say(format!("the driver reports Xid {XID} on {device} ({uuid})"));
    let (taints, dp_health, dra_health) = match poll(|| state(cx, &device, &uuid, true)).await {
        Ok(s) => s,
        Err(e) => return Outcome::Failed(format!("{device} did not turn unhealthy: {e}")),
    };
    let sick_after = injected.elapsed();
    say.say(format!(
        "after {:.1} s: ResourceSlice taint {}, ListAndWatch {dp_health}, DRA health stream {}",
        sick_after.as_secs_f64(),
        list(&taints),
        dra_health.map_or("silent".to_string(), |h| format!("{h:?}"))
    ));
    if let Err(e) = poll(|| state(cx, &device, &uuid, false)).await {
        return Outcome::Failed(format!("{device} did not recover: {e}"));
    }
    let healthy_after = injected.elapsed();
    let quiet = RECOVERY_QUIET_PERIOD;
    say.say(format!(
        "after {:.1} s without another Xid (quiet period {} s): taint gone, ListAndWatch Healthy, DRA health Healthy",
        healthy_after.as_secs_f64(),
        quiet.as_secs()
    ));
    if healthy_after < quiet {
        return Outcome::Failed(format!(
            "{device} recovered after {healthy_after:?}, before the quiet period of {quiet:?}"
        ));
    }
    Outcome::Held(format!(
        "Xid {XID} on {device}: tainted and Unhealthy in both APIs after {:.1} s, healthy again after {:.1} s",
        sick_after.as_secs_f64(),
        healthy_after.as_secs_f64()
    ))
}

/// A device nobody holds, healthy in ListAndWatch and untainted in its slice: (its DRA name,
/// its UUID).
async fn target(cx: &Context<'_>, carry: &Carry) -> Result<(String, String), String> {
    let (_, devices) = published(&cx.client).await?;
    let dp = listed(cx.lab);
    let claimed = carry.claim.as_ref().map(|(_, d)| d.name.clone());
    let target = devices.iter().find(|d| {
        d.taints.is_empty()
            && Some(&d.name) != claimed.as_ref()
            && d.uuid.as_ref().is_some_and(|u| {
                !carry.pod_ids.contains(u) && dp.get(u).is_some_and(|(_, h)| h == "Healthy")
            })
    });
    target
        .and_then(|d| Some((d.name.clone(), d.uuid.clone()?)))
        .ok_or_else(|| "no free, healthy device to inject an Xid into".to_string())
}

/// `Ok` with what each API shows once all three agree that `device` is unhealthy (or, with
/// `want_unhealthy` false, healthy); else what they show now.
async fn state(
    cx: &Context<'_>,
    device: &str,
    uuid: &str,
    want_unhealthy: bool,
) -> Result<Seen, String> {
    let (_, devices) = published(&cx.client).await?;
    let taints: Vec<String> = devices
        .iter()
        .find(|d| d.name == device)
        .map(|d| d.taints.clone())
        .unwrap_or_default();
    let tainted: Vec<String> = taints
        .into_iter()
        .filter(|t| t.starts_with(&format!("{UNHEALTHY_TAINT_KEY}=")))
        .collect();
    let dp_health = listed(cx.lab)
        .get(uuid)
        .map(|(_, h)| h.clone())
        .unwrap_or_default();
    let dra_health = cx
        .lab
        .dra
        .health(DRIVER)
        .and_then(|h| h.health(NODE, device));
    let (want, want_dra) = if want_unhealthy {
        ("Unhealthy", HealthStatus::Unhealthy)
    } else {
        ("Healthy", HealthStatus::Healthy)
    };
    match (
        tainted.is_empty() != want_unhealthy,
        dp_health == want,
        dra_health == Some(want_dra),
    ) {
        (true, true, true) => Ok((tainted, dp_health, dra_health)),
        _ => Err(format!(
            "taints {tainted:?}, ListAndWatch {dp_health:?}, DRA health {dra_health:?}"
        )),
    }
}
