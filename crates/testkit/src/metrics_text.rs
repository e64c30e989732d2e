//! Reading the Prometheus text format back, as the demo and the tests read an agent's
//! `/metrics`: every sample of a family with its labels.

use std::collections::BTreeMap;

/// Every sample of `family` in a Prometheus text body: its labels and value.
pub fn series(body: &str, family: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    body.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(family)?.strip_prefix('{')?;
            let (labels, value) = rest.rsplit_once("} ")?;
            let labels = labels
                .split("\",")
                .filter_map(|kv| {
                    let (k, v) = kv.split_once("=\"")?;
                    Some((k.to_string(), v.trim_end_matches('"').to_string()))
                })
                .collect();
            Some((labels, value.trim().parse().ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn samples_of_the_family_only_with_their_labels() {
        let body =
            "# HELP x y\nfam{a=\"1\",b=\"\"} 2.5\nfam_other{a=\"1\"} 3\nfam{a=\"2\",b=\"x,y\"} 1\n";
        let s = super::series(body, "fam");
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].0["a"], "1");
        assert_eq!(s[0].0["b"], "");
        assert_eq!(s[0].1, 2.5);
        assert_eq!(s[1].0["b"], "x,y");
    }
}
