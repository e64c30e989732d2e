//! The crate edges ARCHITECTURE.md's invariants rest on, checked: the model crate's
//! dependency tree holds no runtime, network, RPC or NVML crate, and unsafe code is refused
//! everywhere but at the NVML edge.

use std::path::Path;
use std::process::Command;

/// What the pure core must never link, directly or through another crate.
const NOT_IN_THE_MODEL: &[&str] = &[
    "tokio",
    "tonic",
    "prost",
    "hyper",
    "h2",
    "tower",
    "kube",
    "kube-client",
    "kube-runtime",
    "rustls",
    "nvml-wrapper",
    "nvml-wrapper-sys",
    "nix",
    // Metrics are the shells' (crates/common/src/metrics.rs).
    "prometheus-client",
];

fn normal_dependencies(package: &str) -> Vec<String> {
    let out = Command::new(env!("CARGO"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["tree", "--offline", "--locked", "-p", package])
        .args(["-e", "normal", "--prefix", "none", "--format", "{p}"])
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree -p {package}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[test]
fn the_model_crate_links_no_runtime_network_rpc_or_nvml_crate() {
    let deps = normal_dependencies("gpuplane-model");
    assert!(
        deps.iter().any(|d| d == "k8s-openapi"),
        "the tree was not read: {deps:?}"
    );
    let found: Vec<&String> = deps
        .iter()
        .filter(|d| NOT_IN_THE_MODEL.contains(&d.as_str()))
        .collect();
    assert!(
        found.is_empty(),
        "gpuplane-model must stay pure, but it links {found:?} (move the code that needs them \
         to the product crate)"
    );
}

/// The two products and what they share. Neither product crate depends on the other, the
/// common crate on neither, and none of them on the test kit: a node agent carries no quota
/// controller, a controller no NVML, and neither a double.
#[test]
fn the_node_and_cluster_crates_share_only_the_common_one() {
    let node = normal_dependencies("gpuplane-node");
    let cluster = normal_dependencies("gpuplane-cluster");
    let common = normal_dependencies("gpuplane-common");
    for (name, deps) in [("node", &node), ("cluster", &cluster)] {
        for needed in ["gpuplane-model", "gpuplane-common"] {
            assert!(
                deps.iter().any(|d| d == needed),
                "{name}: no {needed}: {deps:?}"
            );
        }
    }
    let arrows = [
        ("gpuplane-node", &node, "gpuplane-cluster"),
        ("gpuplane-cluster", &cluster, "gpuplane-node"),
        ("gpuplane-common", &common, "gpuplane-node"),
        ("gpuplane-common", &common, "gpuplane-cluster"),
    ];
    for (from, deps, to) in arrows {
        assert!(
            !deps.iter().any(|d| d == to),
            "{from} must not depend on {to}; move what both need to gpuplane-common: {deps:?}"
        );
    }
    for (from, deps) in [("node", &node), ("cluster", &cluster), ("common", &common)] {
        assert!(
            !deps.iter().any(|d| d == "gpuplane-testkit"),
            "gpuplane-{from} must not depend on the doubles: {deps:?}"
        );
    }
    // NVML and the kubelet's gRPC are the node's alone.
    for crate_only_on_nodes in ["nvml-wrapper", "tonic"] {
        assert!(node.iter().any(|d| d == crate_only_on_nodes));
        assert!(
            !cluster.iter().any(|d| d == crate_only_on_nodes),
            "the cluster side links {crate_only_on_nodes}"
        );
    }
}

#[test]
fn the_fake_nvml_links_only_the_model() {
    let fake = normal_dependencies("fake-nvml");
    assert!(fake.iter().any(|d| d == "gpuplane-model"));
    assert!(
        !fake.iter().any(|d| d == "gpuplane" || d == "tokio"),
        "the fake NVML library loads profiles through the model crate alone: {fake:?}"
    );
}

/// Every `.rs` file under `dir` (relative to the repository), with its text; at least ten.
fn sources(dir: &str) -> Vec<(String, String)> {
    let out = rust_files(dir);
    assert!(out.len() > 10, "no sources under {dir}");
    out
}

/// Every `.rs` file under `dir` (relative to the repository), with its text.
fn rust_files(dir: &str) -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut out = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("a source directory") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("a source file");
                let rel = path.strip_prefix(&root).unwrap().display().to_string();
                out.push((rel, text));
            }
        }
    }
    out.sort();
    assert!(!out.is_empty(), "no sources under {dir}");
    out
}

/// The gRPC edge: the only shell files whose code names protobuf or tonic items (besides
/// `proto.rs`, which includes the generated code). Everything else (the DRA core, the node
/// state, the ledger's callers) sees plain types.
const GRPC_EDGE: &[&str] = &[
    "deviceplugin/registrar.rs",
    "deviceplugin/service.rs",
    "dra/health_service.rs",
    "dra/registration.rs",
    "dra/server.rs",
    "dra/service.rs",
    "grpc/mod.rs",
    "grpc/served.rs",
    "node/podresources.rs",
];

#[test]
fn protobuf_and_tonic_stay_at_the_grpc_edge() {
    let mut naming = Vec::new();
    for (rel, text) in sources("crates/node/src") {
        let code = text
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .any(|l| l.contains("proto::") || l.contains("tonic::") || l.contains("tonic_prost"));
        if code {
            naming.push(rel);
        }
    }
    assert_eq!(
        naming, GRPC_EDGE,
        "protobuf/tonic types outside the gRPC edge: convert to plain types in the service"
    );
    let elsewhere: Vec<String> = ["crates/cluster/src", "crates/common/src"]
        .into_iter()
        .flat_map(rust_files)
        .filter(|(_, text)| text.contains("tonic") || text.contains("proto::"))
        .map(|(rel, _)| rel)
        .collect();
    assert!(elsewhere.is_empty(), "gRPC outside the node: {elsewhere:?}");
}

fn read(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The product crates deny `unwrap` and `expect` (their unit tests exempt), and nothing in
/// them allows either back.
#[test]
fn the_product_crates_deny_unwrap_and_expect() {
    let deny = "deny(clippy::unwrap_used, clippy::expect_used)";
    for lib in [
        "crates/model/src/lib.rs",
        "crates/common/src/lib.rs",
        "crates/node/src/lib.rs",
        "crates/cluster/src/lib.rs",
        "src/main.rs",
    ] {
        assert!(read(lib).contains(deny), "{lib} does not {deny}");
    }
    let product = PRODUCT_SOURCES
        .into_iter()
        .flat_map(|dir| {
            rust_files(dir)
                .into_iter()
                .map(move |(rel, text)| (format!("{dir}/{rel}"), text))
        })
        .chain([("src/main.rs".to_string(), read("src/main.rs"))]);
    for (file, text) in product {
        for lint in ["allow(clippy::unwrap_used", "allow(clippy::expect_used"] {
            assert!(!text.contains(lint), "{file} has {lint}");
        }
    }
}

#[test]
fn unsafe_code_is_refused_outside_the_nvml_edge() {
    assert!(read("crates/model/src/lib.rs").contains("#![forbid(unsafe_code)]"));
    assert!(read("src/main.rs").contains("#![forbid(unsafe_code)]"));
    assert!(read("crates/testkit/src/lib.rs").contains("#![forbid(unsafe_code)]"));
    assert!(read("crates/common/src/lib.rs").contains("#![forbid(unsafe_code)]"));
    assert!(read("crates/cluster/src/lib.rs").contains("#![forbid(unsafe_code)]"));
    assert!(read("crates/node/src/lib.rs").contains("#![deny(unsafe_code)]"));
    // The one exemption in the node agent: the raw NVML calls.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/node/src");
    let mut allowed = Vec::new();
    let mut stack = vec![root.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("src is readable") {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("a source file");
                if text.contains("allow(unsafe_code)") {
                    allowed.push(path.strip_prefix(&root).unwrap().display().to_string());
                }
            }
        }
    }
    assert_eq!(
        allowed,
        ["nvml/mod.rs"],
        "only `mod raw` may allow unsafe code"
    );
}

/// The product's library sources: the pure core and the three shell crates.
const PRODUCT_SOURCES: [&str; 4] = [
    "crates/model/src",
    "crates/common/src",
    "crates/node/src",
    "crates/cluster/src",
];

/// Where the Rust sources of every package in the workspace live: the model, the shells, the
/// test kit (doubles, labs, the demo), the binary, the fake NVML and MPS, and the benches.
/// `every_workspace_member_is_held_to_the_size_limits` keeps the list in step with Cargo.toml.
const SIZED_SOURCES: &[&str] = &[
    "crates/model/src",
    "crates/common/src",
    "crates/node/src",
    "crates/cluster/src",
    "crates/testkit/src",
    "src",
    "hack/fake-nvml/src",
    "hack/fake-mps/src",
    "benches",
];

/// The code stays readable, in every crate: no file over 600 lines of non-test code and no
/// function over 80 lines. Test code does not count: `tests.rs` files (and `*_tests.rs`), a
/// file's `#[cfg(test)]` tail, and the integration tests under `tests/`, which read best as
/// one story per file. Generated code (the protobuf bindings in `OUT_DIR`) is not in these
/// directories. `fuzz/` is a workspace of its own whose targets are one line each.
#[test]
fn files_and_functions_stay_small_in_every_crate() {
    const FILE_LINES: usize = 600;
    const FN_LINES: usize = 80;
    let mut too_long = Vec::new();
    for dir in SIZED_SOURCES {
        for (rel, text) in rust_files(dir) {
            if rel.ends_with("tests.rs") {
                continue;
            }
            let lines = non_test_lines(&text);
            if lines.len() > FILE_LINES {
                too_long.push(format!("{dir}/{rel}: {} lines", lines.len()));
            }
            for (start, end) in long_functions(&lines, FN_LINES) {
                too_long.push(format!("{dir}/{rel}:{}: a {end}-line function", start + 1));
            }
        }
    }
    assert!(too_long.is_empty(), "split these: {too_long:#?}");
}

/// The functions among `lines` longer than `limit` lines: where each starts (0-based) and how
/// many lines it has, from its `fn` line to the `}` at the same indentation.
fn long_functions(lines: &[&str], limit: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let Some(indent) = fn_indent(line) else {
            continue;
        };
        let close = format!("{}}}", " ".repeat(indent));
        let end = lines[start..]
            .iter()
            .position(|l| *l == close)
            .map_or(lines.len() - start, |n| n + 1);
        if end > limit {
            out.push((start, end));
        }
    }
    out
}

/// The tests are held to limits of their own, looser than the product's (a test tells one
/// story, with its assertions inline): no file under `tests/` over 800 lines, split by theme
/// into a module directory instead, and no function over 120 lines, split into named steps.
/// Every line counts here.
#[test]
fn test_files_and_functions_stay_small() {
    const FILE_LINES: usize = 800;
    const FN_LINES: usize = 120;
    let mut too_long = Vec::new();
    for (rel, text) in sources("tests") {
        let lines: Vec<&str> = text.lines().collect();
        if lines.len() > FILE_LINES {
            too_long.push(format!("tests/{rel}: {} lines", lines.len()));
        }
        for (start, end) in long_functions(&lines, FN_LINES) {
            too_long.push(format!("tests/{rel}:{}: a {end}-line function", start + 1));
        }
    }
    assert!(too_long.is_empty(), "split these: {too_long:#?}");
}

/// Polling has one home, tests/support/eventually.rs (with the test kit's doubles' own
/// `wait_for`/`wait_until` methods, outside `tests/`): no other file under `tests/` defines a
/// function (or method) of the names polling helpers go by; tests call the shared one.
#[test]
fn polling_helpers_live_only_in_the_support_module() {
    const POLLING: &[&str] = &["eventually", "wait_until", "wait_for"];
    let mut copies = Vec::new();
    for (rel, text) in sources("tests") {
        if rel.starts_with("support/") {
            continue;
        }
        for (n, line) in text.lines().enumerate() {
            if fn_name(line).is_some_and(|name| POLLING.contains(&name)) {
                copies.push(format!("tests/{rel}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        copies.is_empty(),
        "use tests/support/eventually.rs instead of these: {copies:#?}"
    );
}

/// The name of the function a line declares (`fn name`, `pub async fn name<T>(`, ...).
fn fn_name(line: &str) -> Option<&str> {
    let (_, rest) = fn_declaration(line)?;
    rest.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .next()
        .filter(|n| !n.is_empty())
}

/// A new crate is not silently exempt from the size limits: every member of the workspace
/// has its sources in [`SIZED_SOURCES`].
#[test]
fn every_workspace_member_is_held_to_the_size_limits() {
    let manifest = read("Cargo.toml");
    let members = manifest
        .lines()
        .find_map(|l| l.trim().strip_prefix("members = ["))
        .expect("Cargo.toml lists the workspace members on one line");
    let members: Vec<&str> = members
        .trim_end_matches(']')
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .collect();
    assert!(members.len() >= 5, "members not read: {members:?}");
    for member in members {
        let src = match member {
            "." => "src".to_string(),
            m => format!("{m}/src"),
        };
        assert!(
            SIZED_SOURCES.contains(&src.as_str()),
            "workspace member {member} is not in SIZED_SOURCES"
        );
    }
}

/// A file's non-test lines: everything before its `#[cfg(test)]` tail (an inline
/// `mod tests { .. }`), less the one-line `#[cfg(test)] mod name;` declarations, which may
/// stand anywhere and must not hide the code after them.
fn non_test_lines(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if line.starts_with("#[cfg(test)]") {
            match lines.peek() {
                Some(next) if next.starts_with("mod ") && next.ends_with(';') => {
                    lines.next();
                    continue;
                }
                _ => break,
            }
        }
        out.push(line);
    }
    out
}

/// The indentation of a line that opens a function body (`fn`, `pub fn`, `async fn`, ...).
fn fn_indent(line: &str) -> Option<usize> {
    let (indent, _) = fn_declaration(line)?;
    (!line.trim_end().ends_with(';')).then_some(indent)
}

/// A line that declares a function (`fn`, after `pub`, `async`, `const` or `unsafe`): its
/// indentation, and what follows `fn` (the name first).
fn fn_declaration(line: &str) -> Option<(usize, &str)> {
    let mut rest = line.trim_start();
    let indent = line.len() - rest.len();
    while let Some(word) = rest.split_whitespace().next() {
        rest = rest[word.len()..].trim_start();
        if word == "fn" {
            return Some((indent, rest));
        }
        if !(word == "pub"
            || word.starts_with("pub(")
            || ["async", "const", "unsafe"].contains(&word))
        {
            return None;
        }
    }
    None
}

/// The node's inventory has two writers (ARCHITECTURE.md, `node/`): the state owner, for
/// discovery, driver events and config (`owner.rs`, and `mod.rs` installing the first discovery),
/// and the DRA core, for the dynamic-MIG instances it has just created or destroyed
/// (`dra/core/instances.rs`: synchronously, as a prepare's answer names the instance, the way
/// Allocate changes the ledger). Any other file that replaces the inventory, writes its GPUs or
/// changes which instances are ours fails here.
#[test]
fn only_the_state_owner_and_the_dra_cores_instances_write_the_inventory() {
    let writes = [
        "replace_inventory(",
        ".inventory = ",
        "inventory.gpus.iter_mut()",
        "inventory.gpus.push(",
        ".mig_owned = ",
        ".mig_owned.remove(",
        ".mig_owned.insert(",
        "Snapshot::with_mig_owned(",
        "Snapshot::new(",
    ];
    let allowed = [
        "state.rs",
        "node/owner.rs",
        "node/mod.rs",
        "dra/core/instances.rs",
    ];
    let mut found = Vec::new();
    for (rel, text) in sources("crates/node/src") {
        if allowed.contains(&rel.as_str()) {
            continue;
        }
        for line in non_test_lines(&text) {
            if let Some(w) = writes.iter().find(|w| line.contains(*w)) {
                found.push(format!("{rel}: {w}: {}", line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "inventory written outside its owners: {found:#?}"
    );
}

/// The top-level modules a file's code (not its comments or tests) names through
/// `crate::`: `crate::quota::Charge` and `use crate::{quota, sim}` alike.
fn crate_modules_named(text: &str) -> std::collections::BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = std::collections::BTreeSet::new();
    for line in non_test_lines(text) {
        let code = line.split("//").next().unwrap_or("");
        for (at, _) in code.match_indices("crate::") {
            let rest = &code[at + "crate::".len()..];
            if let Some(list) = rest.strip_prefix('{') {
                let list = list.split('}').next().unwrap_or("");
                out.extend(list.split(',').map(|m| ident(m.trim())));
            } else {
                out.insert(ident(rest));
            }
        }
    }
    out.retain(|m| !m.is_empty());
    out
}

/// Each crate is layered: no two of its top-level modules (the model's `config`, `quota`,
/// `inventory`; the agent's `node`, `dra`, `state`; the cluster's `controller`, `webhook`,
/// `elector`) name each other, directly or around a circle, so each can be read and tested from
/// the bottom up, and the one on top (`node`, `replica`) is where the parts meet.
#[test]
fn no_crates_modules_form_a_circle() {
    for (dir, at_least) in [
        ("crates/model/src", 15),
        ("crates/node/src", 12),
        ("crates/cluster/src", 7),
        ("crates/common/src", 3),
    ] {
        let files = rust_files(dir);
        if let Some(circle) = module_circle(files, dir, at_least) {
            panic!(
                "{dir}: modules name each other around a circle: {}; move what both need below \
                 them",
                circle.join(" -> ")
            );
        }
    }
}

/// A circle among the top-level modules of the crate at `dir` (read from at least `at_least`
/// of them), if there is one.
fn module_circle(files: Vec<(String, String)>, dir: &str, at_least: usize) -> Option<Vec<String>> {
    type Edges = std::collections::BTreeMap<String, std::collections::BTreeSet<String>>;
    let mut edges = Edges::new();
    for (rel, text) in files {
        let module = rel.split(['/', '.']).next().unwrap_or_default().to_string();
        if rel.contains("tests") || module == "lib" {
            continue;
        }
        let named = crate_modules_named(&text);
        edges
            .entry(module.clone())
            .or_default()
            .extend(named.into_iter().filter(|m| *m != module));
    }
    assert!(
        edges.len() >= at_least,
        "the modules of {dir} were not read: {edges:?}"
    );
    // A depth-first walk; a module met again on the current path closes a circle.
    fn walk(
        m: &str,
        edges: &Edges,
        path: &mut Vec<String>,
        done: &mut std::collections::BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut circle = path[at..].to_vec();
            circle.push(m.to_string());
            return Some(circle);
        }
        if !done.insert(m.to_string()) {
            return None;
        }
        path.push(m.to_string());
        for next in edges.get(m).into_iter().flatten() {
            if let Some(c) = walk(next, edges, path, done) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    let mut done = Default::default();
    edges
        .keys()
        .find_map(|m| walk(m, &edges, &mut Vec::new(), &mut done))
}
