//! The real-Kubernetes tier as one test binary: the upstream kube-apiserver, scheduler,
//! controller manager, kubelets and containerd of `hack/cluster/lab.sh`, with gpuplane deployed
//! as users deploy it. One lab runs at a time (`cluster::ClusterLab` holds the machine's one lab
//! slot); tests that need no lab (rendering the chart, say) run beside it. Skips when not root
//! or the cluster binaries are not built (`hack/cluster/build.sh`); fails instead under `CI`.

#[path = "../cluster/mod.rs"]
mod cluster;

#[path = "../support/mod.rs"]
mod support;

mod deploy;
mod deploy_dynamic_mig;
mod deploy_mps;
mod deploy_telemetry;
mod helm;
mod real_cluster;
mod real_cluster_busy_hours;
mod real_cluster_doctor;
mod real_cluster_dynamic_mig;
mod real_cluster_explain;
mod real_cluster_gpu_hours;
mod real_cluster_pending;
mod real_cluster_preemption;
mod real_cluster_quota;
mod real_cluster_shares;
mod real_cluster_shares_quota;
mod real_cluster_telemetry;
