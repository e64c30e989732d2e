//! Step 3: device telemetry. The simulated driver says what two GPUs of one pod are doing
//! (the 4-GPU pod of step 2, or a 2-GPU pod of its own, ended after), one busy and one idle; the agent's
//! `/metrics`, fetched over HTTP, must report each GPU's utilization and memory labelled with
//! that pod and container, and a GPU nobody holds with no holder.

use super::{listed, poll, published, Carry, Context, NODE_NAMESPACE};
use crate::demo::summary::Outcome;
use crate::demo::Narrator;
use gpuplane_model::quota::catalog::GPU_RESOURCE;
use std::collections::BTreeMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const GIB: u64 = 1 << 30;
/// The step's own pod, where step 2 left no pod with two GPUs.
const OWN_POD: &str = "watch-2gpu";

pub(super) async fn run(cx: &Context<'_>, carry: &mut Carry, say: &mut Narrator<'_>) -> Outcome {
    let (pod, held) = match held_pair(cx, carry).await {
        Ok(p) => p,
        Err(outcome) => return outcome,
    };
    let outcome = show(cx, carry, say, pod, &held).await;
    cx.lab.sim.set_telemetry(Default::default());
    if pod != OWN_POD {
        return outcome;
    }
    // The pod ends; the later steps need its GPUs back in both APIs, as before this step:
    // released in the ledger, Healthy in ListAndWatch and published untainted in the slices.
    cx.lab.kubelet.end_pod(NODE_NAMESPACE, OWN_POD);
    let released = poll(|| async {
        let body = scrape(cx).await?;
        let holders = crate::metrics_text::series(&body, "gpuplane_device_holder_info");
        if holders
            .iter()
            .any(|(l, _)| l.get("pod").map(String::as_str) == Some(OWN_POD))
        {
            return Err(format!("{OWN_POD} still holds GPUs"));
        }
        let offered = listed(cx.lab);
        let (_, devices) = published(&cx.client).await?;
        let back = held.iter().all(|u| {
            offered.get(u).is_some_and(|(_, h)| h == "Healthy")
                && devices
                    .iter()
                    .any(|d| d.uuid.as_ref() == Some(u) && d.taints.is_empty())
        });
        back.then_some(())
            .ok_or_else(|| format!("{} not offered again yet", held.join(", ")))
    })
    .await;
    match (released, outcome) {
        (Err(e), Outcome::Held(_)) => Outcome::Failed(format!("ending {OWN_POD}: {e}")),
        (_, outcome) => outcome,
    }
}

/// Has the driver report `held` busy and idle, and reads `/metrics` back.
async fn show(
    cx: &Context<'_>,
    carry: &Carry,
    say: &mut Narrator<'_>,
    pod: &str,
    held: &[String],
) -> Outcome {
    let [busy, idle] = [&held[0], &held[1]];
    let unheld = cx
        .inventory
        .gpus
        .iter()
        .map(|g| g.uuid.to_string())
        .find(|u| !carry.pod_ids.contains(u) && !held.contains(u));
    let text = serde_json::json!({"devices": {
        busy.clone(): {"gpuUtil": 85, "memoryUtil": 40, "memoryUsedBytes": 30 * GIB},
        idle.clone(): {"gpuUtil": 0, "memoryUsedBytes": GIB}
    }})
    .to_string();
    match gpuplane_model::sim::telemetry::parse("the demo's telemetry", &text) {
        Ok(file) => cx.lab.sim.set_telemetry(file),
        Err(e) => return Outcome::Failed(e),
    }
    say.say(format!(
        "the simulated driver reports {busy} 85% busy with 30 GiB used and {idle} idle, both held by {NODE_NAMESPACE}/{pod}"
    ));
    let want = format!("{NODE_NAMESPACE}/{pod}/main via device-plugin");
    // PodResources names the container within a listing or two of the Allocate; until then the
    // GPUs are held by a container not known yet.
    let seen = poll(|| async {
        let body = scrape(cx).await?;
        let util = |uuid: &str| reading(&body, "gpuplane_device_gpu_utilization_ratio", uuid);
        match (util(busy), util(idle)) {
            (Some(b), Some(i))
                if b.1 > 0.8 && i.1 < 0.01 && holder(&b.0) == want && holder(&i.0) == want =>
            {
                Ok((b.1, body))
            }
            other => Err(format!("utilization and holders so far: {other:?}")),
        }
    })
    .await;
    let (busy_util, body) = match seen {
        Ok(s) => s,
        Err(e) => {
            return Outcome::Failed(format!("/metrics never showed the readings on {want}: {e}"))
        }
    };
    let memory = reading(&body, "gpuplane_device_memory_used_bytes", busy).map(|(_, v)| v);
    say.say(format!(
        "/metrics: {busy} gpu_utilization {busy_util:.2}, memory_used {:.0} GiB, for {want}; {idle} at 0 for the same pod (held and idle)",
        memory.unwrap_or(0.0) / GIB as f64
    ));
    let Some(unheld) = unheld else {
        return Outcome::Held(format!("{busy} 85% busy and {idle} idle, both on {want}"));
    };
    match reading(&body, "gpuplane_device_up", &unheld) {
        Some((l, v)) if v == 1.0 && l.get("pod").is_none_or(String::is_empty) => {
            say.say(format!(
                "{unheld}, held by no one, still reports (up 1, no holder)"
            ));
            Outcome::Held(format!(
                "{busy} 85% busy and {idle} idle, both on {want}; an unheld GPU reports with no holder"
            ))
        }
        other => Outcome::Failed(format!("unheld {unheld} reported as {other:?}")),
    }
}

/// A series' holder, as `namespace/pod/container via api`.
fn holder(l: &BTreeMap<String, String>) -> String {
    let get = |k: &str| l.get(k).map_or("", String::as_str);
    format!(
        "{}/{}/{} via {}",
        get("namespace"),
        get("pod"),
        get("container"),
        get("api")
    )
}

/// Two GPUs one pod holds through the device plugin API: the 4-GPU pod's (step 2), or those of
/// a 2-GPU pod admitted here. The pod's name and the GPUs' UUIDs.
async fn held_pair(
    cx: &Context<'_>,
    carry: &Carry,
) -> Result<(&'static str, Vec<String>), Outcome> {
    if let [a, b, ..] = carry.pod_ids.as_slice() {
        return Ok(("train-4gpu", vec![a.clone(), b.clone()]));
    }
    let pod = OWN_POD;
    match cx
        .lab
        .kubelet
        .admit(NODE_NAMESPACE, pod, "main", GPU_RESOURCE, 2)
        .await
    {
        Ok((ids, _)) if ids.len() == 2 => Ok((pod, ids)),
        Ok((ids, _)) => Err(Outcome::Failed(format!("Allocate of 2 GPUs gave {ids:?}"))),
        Err(s) => Err(Outcome::Skipped(format!(
            "{} cannot give one pod 2 whole GPUs as {GPU_RESOURCE}: {}",
            cx.profile,
            s.message()
        ))),
    }
}

/// The agent's `/metrics` body: one HTTP/1.0 GET.
async fn scrape(cx: &Context<'_>) -> Result<String, String> {
    let fail = |e: std::io::Error| format!("GET http://{}/metrics: {e}", cx.agent_metrics);
    let mut s = tokio::net::TcpStream::connect(cx.agent_metrics)
        .await
        .map_err(fail)?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: agent\r\n\r\n")
        .await
        .map_err(fail)?;
    let mut text = String::new();
    s.read_to_string(&mut text).await.map_err(fail)?;
    Ok(text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default())
}

/// The labels and value of `family`'s sample for device `uuid`.
fn reading(body: &str, family: &str, uuid: &str) -> Option<(BTreeMap<String, String>, f64)> {
    crate::metrics_text::series(body, family)
        .into_iter()
        .find(|(l, _)| l.get("uuid").map(String::as_str) == Some(uuid))
}
