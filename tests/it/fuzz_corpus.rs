//! Replays every file of `fuzz/corpus/<target>/` through that fuzz target's check
//! (`gpuplane_testkit::fuzzing`), so the corpus, and every crash the fuzzers once found, is exercised on
//! stable in every test run. `./hack/fuzz.sh` runs the fuzzers themselves.

use gpuplane_testkit::fuzzing::{self, TARGETS};
use std::path::{Path, PathBuf};

fn corpus_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus")
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    out.sort();
    out
}

#[test]
fn every_corpus_file_passes_its_targets_check() {
    let mut replayed = 0;
    for dir in files_and_dirs(&corpus_root()) {
        let name = dir.file_name().unwrap().to_str().unwrap().to_string();
        let check = fuzzing::target(&name)
            .unwrap_or_else(|| panic!("fuzz/corpus/{name} belongs to no fuzz target"));
        for file in files(&dir) {
            let bytes = std::fs::read(&file).unwrap();
            let outcome = std::panic::catch_unwind(|| check(&bytes));
            assert!(outcome.is_ok(), "{} fails its check", file.display());
            replayed += 1;
        }
    }
    assert!(replayed >= TARGETS.len(), "only {replayed} files replayed");
}

fn files_and_dirs(root: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    out.sort();
    out
}

#[test]
fn every_fuzz_target_has_a_seeded_corpus_and_a_binary() {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/Cargo.toml"))
            .unwrap();
    for (name, _) in TARGETS {
        let dir = corpus_root().join(name);
        assert!(
            dir.is_dir() && !files(&dir).is_empty(),
            "fuzz/corpus/{name} is missing or empty"
        );
        assert!(
            manifest.contains(&format!("name = \"{name}\"")),
            "fuzz/Cargo.toml has no [[bin]] {name}"
        );
    }
}

/// The checkpoint seeds are what the agent itself writes: decoding and encoding them again
/// gives the same bytes, header included.
#[test]
fn checkpoint_seeds_are_byte_for_byte_what_the_agent_writes() {
    let dir = corpus_root().join("checkpoint");
    let seeds: Vec<PathBuf> = files(&dir)
        .into_iter()
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("seed-")
        })
        .collect();
    assert!(!seeds.is_empty());
    for seed in seeds {
        let bytes = std::fs::read(&seed).unwrap();
        let data = gpuplane_node::dra::checkpoint::decode(&bytes)
            .unwrap_or_else(|e| panic!("{}: {e}", seed.display()));
        assert_eq!(
            gpuplane_node::dra::checkpoint::encode(&data).unwrap(),
            bytes,
            "{}",
            seed.display()
        );
    }
}

/// Files named `hostile-*` (inputs made to be refused) or `crash-*` (inputs a fuzzer once
/// crashed on); the rest are seeds.
fn seeds(target: &str) -> Vec<PathBuf> {
    files(&corpus_root().join(target))
        .into_iter()
        .filter(|p| {
            let name = p.file_name().unwrap().to_str().unwrap();
            !name.starts_with("hostile-") && !name.starts_with("crash-")
        })
        .collect()
}

/// The seeds of the other decoders are accepted inputs, so the fuzzers start from the valid
/// shapes rather than from errors.
#[test]
fn profile_config_and_opaque_seeds_are_accepted() {
    for f in seeds("sim_profile") {
        let text = std::fs::read_to_string(&f).unwrap();
        gpuplane_model::sim::from_str("seed", "seed", &text)
            .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
    }
    for f in seeds("agent_config") {
        let text = std::fs::read_to_string(&f).unwrap();
        gpuplane_model::config::AgentConfig::parse("seed", &text)
            .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
    }
    for f in seeds("opaque_config") {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&f).unwrap()).unwrap();
        gpuplane_node::dra::opaque::parse(&v).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
    }
    for f in seeds("admission_review") {
        gpuplane_cluster::webhook::review::decode(&std::fs::read(&f).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", f.display()));
    }
}
