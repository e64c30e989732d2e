//! The quota sentences the docs show are the product's: every "`<dimension>`: requested ...,
//! used ... of ... in GpuQuota ..." in README.md and docs/ is rendered again by the quota check
//! from its own numbers and must come out word for word, so a change of wording or number
//! format fails here until the docs follow. The old wording ("needs 2 gpus, 0 free of 4") is
//! gone everywhere.

use gpuplane_model::quota::{check, Charge, GpuQuota, Gpus, Memory, Usage};
use serde_json::json;
use std::path::Path;

/// The user-facing Markdown: the README and every file under docs/.
fn markdown() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            // Markdown wraps a sentence anywhere: one space for each run of whitespace.
            let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
            (p.strip_prefix(root).unwrap().display().to_string(), flat)
        })
        .collect()
}

/// One documented denial clause.
#[derive(Debug)]
struct Clause {
    file: String,
    text: String,
    dimension: String,
    requested: String,
    used: String,
    hard: String,
    quota: (String, String),
}

/// Every "`<dimension>`: requested R, used U of H in GpuQuota ns/name" in `text`.
fn clauses(file: &str, text: &str) -> Vec<Clause> {
    let mut out = Vec::new();
    for (at, _) in text.match_indices(": requested ") {
        let dimension = text[..at]
            .rsplit(|c: char| c.is_whitespace() || c == '`' || c == '"' || c == '(')
            .next()
            .unwrap_or_default();
        let rest = &text[at + ": requested ".len()..];
        let words: Vec<&str> = rest.splitn(9, ' ').collect();
        // R, used U of H in <kind> ns/name
        if words.len() < 8 || words[1] != "used" || words[3] != "of" || words[5] != "in" {
            continue;
        }
        let id = words[7].trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
        let Some((ns, name)) = id.split_once('/') else {
            continue;
        };
        let requested = words[0].trim_end_matches(',');
        // The docs' own words, from the dimension to the quota's name.
        let end = words[..7].iter().map(|w| w.len() + 1).sum::<usize>() + id.len();
        out.push(Clause {
            file: file.to_string(),
            text: format!("{dimension}: requested {}", &rest[..end]),
            dimension: dimension.to_string(),
            requested: requested.to_string(),
            used: words[2].to_string(),
            hard: words[4].to_string(),
            quota: (ns.to_string(), name.to_string()),
        });
    }
    out
}

/// A usage of `amount` in `dimension` alone, read as the product reads a quota's numbers.
fn usage(c: &Clause, amount: &str) -> Usage {
    let mut u = Usage::default();
    match c.dimension.as_str() {
        "gpus" => {
            u.gpus = amount
                .parse::<Gpus>()
                .unwrap_or_else(|e| panic!("{c:?}: {e}"))
        }
        "gpuMemory" => {
            u.gpu_memory = Memory::parse(amount).unwrap_or_else(|e| panic!("{c:?}: {e}"))
        }
        other => panic!(
            "{}: a documented dimension the test cannot render: {other}",
            c.file
        ),
    }
    u
}

/// What the quota check says when `c`'s request meets `c`'s quota.
fn rendered(c: &Clause) -> String {
    let hard = serde_json::to_value(usage(c, &c.hard)).unwrap();
    let used = serde_json::to_value(usage(c, &c.used)).unwrap();
    let quota: GpuQuota = serde_json::from_value(json!({
        "apiVersion": "quota.gpuplane.dev/v1alpha1", "kind": "GpuQuota",
        "metadata": {"namespace": c.quota.0, "name": c.quota.1},
        "spec": {"hard": {c.dimension.clone(): hard[&c.dimension]}},
        "status": {"used": {c.dimension.clone(): used[&c.dimension]}},
    }))
    .unwrap_or_else(|e| panic!("{c:?}: {e}"));
    let charge = Charge {
        usage: usage(c, &c.requested),
        unknown: Vec::new(),
    };
    match check(&quota, &[], None, &charge) {
        Ok(_) => panic!("{}: `{}` is admitted by the product", c.file, c.text),
        Err(denial) => denial.to_string(),
    }
}

#[test]
fn every_documented_quota_denial_is_what_the_quota_check_says() {
    let docs = markdown();
    let found: Vec<Clause> = docs.iter().flat_map(|(f, t)| clauses(f, t)).collect();
    assert!(
        found.len() >= 8,
        "the docs show quota denials in several places; found only {found:#?}"
    );
    for c in &found {
        let said = rendered(c);
        assert!(
            said.split("; ").any(|clause| clause == c.text),
            "{}: the docs say `{}`, the product says `{said}`",
            c.file,
            c.text
        );
    }
    for (file, text) in &docs {
        assert!(
            !text.contains(" free of "),
            "{file}: the old wording (\"needs N gpus, M free of H\") is back"
        );
    }
}

/// docs/troubleshooting.md names every reason `explain` can give, in the JSON fields' `reason`
/// row and with a row of its own in the reasons table, and no reason the product lacks.
#[test]
fn every_reason_explain_gives_is_documented_and_no_other() {
    use gpuplane_cluster::explain_cli::Reason;
    let docs = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/troubleshooting.md"),
    )
    .unwrap();
    let mut product: Vec<&str> = Reason::WAITING.iter().map(|r| r.as_str()).collect();
    product.sort();
    let row = docs
        .lines()
        .find(|l| l.starts_with("| `reason` |"))
        .expect("the JSON fields table's reason row");
    let listed = row.split('(').nth(1).unwrap().split(';').next().unwrap();
    let mut in_json_row: Vec<&str> = listed
        .split(',')
        .map(|r| r.trim().trim_matches('`'))
        .collect();
    in_json_row.sort();
    assert_eq!(in_json_row, product, "{row}");
    let mut table_rows: Vec<&str> = docs
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once("` |").map(|(name, _)| name))
        .filter(|name| *name != "NotWaiting" && Reason::parse(name).is_some())
        .collect();
    table_rows.sort();
    table_rows.dedup();
    assert_eq!(
        table_rows, product,
        "a reason without its row in the reasons table"
    );
    assert!(row.contains("`NotWaiting`"), "{row}");
}
