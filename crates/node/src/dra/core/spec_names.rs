//! What a claim's names become: its UID (checked at the gRPC edge, see
//! `gpuplane_model::dra::identity`) names its spec file and its CDI devices.

use crate::dra::ClaimUid;

/// CDI class of the per-claim specs; the vendor is `k8s.<driver>`.
pub const CDI_CLASS: &str = "claim";
/// File stem prefix of the per-claim specs: `gpuplane-claim-<uid>`.
const SPEC_STEM_PREFIX: &str = "gpuplane-claim-";

/// `gpuplane-claim-<uid>`: the spec file stem of a claim.
pub fn spec_stem(uid: &ClaimUid) -> String {
    format!("{SPEC_STEM_PREFIX}{uid}")
}

/// Whether `stem` is a claim spec's (`gpuplane-claim-…`): the only specs the claim paths may
/// restore or remove, whatever a damaged or hand-edited checkpoint names.
pub fn is_claim_spec_stem(stem: &str) -> bool {
    stem.starts_with(SPEC_STEM_PREFIX)
}

/// `<uid>-<DRA device name>`: the CDI device name of a claim's device.
pub fn cdi_device_name(uid: &ClaimUid, device: &str) -> String {
    format!("{uid}-{device}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cdi;
    use std::path::Path;

    #[test]
    fn a_claim_uid_names_one_spec_file_in_the_cdi_root() {
        let uid = ClaimUid::parse("ab-12").unwrap();
        assert_eq!(spec_stem(&uid), "gpuplane-claim-ab-12");
        assert!(cdi::writer::spec_path(Path::new("/x"), &spec_stem(&uid)).is_ok());
        assert_eq!(cdi_device_name(&uid, "gpu-0"), "ab-12-gpu-0");
    }
}
