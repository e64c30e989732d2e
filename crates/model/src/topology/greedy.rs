//! The greedy half of [`super::preference`]: a good answer fast, which becomes the
//! incumbent the exact search has to beat.

use super::pool::{Bits, Pick, Pool};
use std::cmp::Reverse;

/// Greedy construction from every seed (or from `must` when non-empty), each improved by
/// best-improvement pairwise swaps until none helps; the best result by the objective.
pub(super) fn heuristic(pool: &Pool<'_>, must: u128, size: usize) -> Pick {
    let model = pool.model;
    let avail = pool.avail;
    let seeds: Vec<u128> = if must != 0 {
        vec![must]
    } else {
        Bits(avail).map(|x| 1u128 << x).collect()
    };
    // in_s[y] = sum of pair(y, s) over s in the current set.
    let mut in_s = vec![0u64; model.n];
    let mut best: Option<Pick> = None;
    let mut seen: Vec<u128> = Vec::new();
    for seed in seeds {
        for y in Bits(avail) {
            in_s[y] = Bits(seed).map(|s| model.pair(y, s)).sum();
        }
        let mut cur = pool.pick(seed);
        while (cur.mask.count_ones() as usize) < size {
            let mut choice: Option<(usize, u64, u64)> = None;
            for x in Bits(avail & !cur.mask) {
                let better = match choice {
                    None => true,
                    Some((_, g, t)) => (in_s[x], Reverse(pool.tot[x])) > (g, Reverse(t)),
                };
                if better {
                    choice = Some((x, in_s[x], pool.tot[x]));
                }
            }
            let Some((x, gain, tot)) = choice else { break };
            cur.mask |= 1u128 << x;
            cur.score += gain;
            cur.tot += tot;
            let row = model.row(x);
            for y in Bits(avail) {
                in_s[y] += row[y];
            }
        }
        // Seeds inside one tight group all grow into the same set; improve it only once.
        if seen.contains(&cur.mask) {
            continue;
        }
        seen.push(cur.mask);
        loop {
            let mut swap: Option<(usize, usize)> = None;
            let (mut best_score, mut best_tot) = (cur.score, cur.tot);
            for s in Bits(cur.mask & !must) {
                let without = cur.score - in_s[s];
                let row = model.row(s);
                for t in Bits(avail & !cur.mask) {
                    let score = without + (in_s[t] - row[t]);
                    let tot = cur.tot - pool.tot[s] + pool.tot[t];
                    if (score, Reverse(tot)) > (best_score, Reverse(best_tot)) {
                        swap = Some((s, t));
                        best_score = score;
                        best_tot = tot;
                    }
                }
            }
            let Some((s, t)) = swap else { break };
            cur.mask = (cur.mask & !(1u128 << s)) | (1u128 << t);
            cur.score = best_score;
            cur.tot = best_tot;
            let (row_t, row_s) = (model.row(t), model.row(s));
            for y in Bits(avail) {
                in_s[y] = in_s[y] + row_t[y] - row_s[y];
            }
        }
        if best.is_none_or(|b| cur.better_than(&b)) {
            best = Some(cur);
        }
    }
    best.unwrap_or_else(|| pool.pick(must))
}
