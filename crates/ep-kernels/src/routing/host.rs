//! Host twin of the routing kernel (also the CPU router of `moe-layer`).

use std::cmp::Ordering;

use super::{scoring, GroupScore, Scoring, TopkInput, TopkSpec};
use crate::error::Result;

/// Reused per-token buffers of [`select`].
#[derive(Default)]
struct SelectScratch {
    key: Vec<f32>,
    group_score: Vec<f32>,
    groups: Vec<usize>,
    candidates: Vec<usize>,
}

/// Routes `t` tokens: `scores` `[t, E]` (or logits, as `input` says), `bias` `[E]` (optional)
/// -> `topk_idx` `[t, K]`, `topk_weights` `[t, K]`. See the module docs for the rule.
pub fn route_topk(
    scores: &[f32],
    input: TopkInput,
    bias: Option<&[f32]>,
    spec: &TopkSpec,
    topk_idx: &mut [i64],
    topk_weights: &mut [f32],
) -> Result<()> {
    spec.check(false)?;
    let (e, k) = (spec.num_experts, spec.top_k);
    spec.check_lengths(
        scores.len(),
        bias.map(<[f32]>::len),
        topk_idx.len(),
        topk_weights.len(),
    )?;
    let mut s = SelectScratch::default();
    // One token's scores when `scores` holds logits.
    let mut score = vec![0f32; e];
    for (i, row) in scores.chunks_exact(e).enumerate() {
        let row = match input {
            TopkInput::Scores => row,
            TopkInput::Logits(Scoring::Sigmoid) => {
                for (o, &l) in score.iter_mut().zip(row) {
                    *o = scoring::sigmoid(l);
                }
                &score
            }
            TopkInput::Logits(Scoring::Softmax) => {
                scoring::softmax(row, &mut score);
                &score
            }
        };
        select(
            row,
            bias,
            spec,
            &mut s,
            &mut topk_idx[i * k..(i + 1) * k],
            &mut topk_weights[i * k..(i + 1) * k],
        );
    }
    Ok(())
}

/// Chooses one token's experts.
fn select(
    scores: &[f32],
    bias: Option<&[f32]>,
    spec: &TopkSpec,
    s: &mut SelectScratch,
    idx: &mut [i64],
    weights: &mut [f32],
) {
    let e = scores.len();
    s.key.clear();
    match bias {
        Some(b) => s.key.extend(scores.iter().zip(b).map(|(a, b)| a + b)),
        None => s.key.extend_from_slice(scores),
    }
    let key = &s.key;
    // Descending key, lower id first on ties.
    let better = |a: &usize, b: &usize| -> Ordering { key[*b].total_cmp(&key[*a]).then(a.cmp(b)) };

    s.candidates.clear();
    if spec.group_score == GroupScore::None || spec.n_group == 1 {
        s.candidates.extend(0..e);
    } else {
        let per_group = e / spec.n_group;
        s.group_score.clear();
        for g in 0..spec.n_group {
            let members = &key[g * per_group..(g + 1) * per_group];
            let score = match spec.group_score {
                GroupScore::Top2Sum => top2_sum(members),
                _ => members.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            };
            s.group_score.push(score);
        }
        s.groups.clear();
        s.groups.extend(0..spec.n_group);
        let gs = &s.group_score;
        s.groups
            .sort_by(|a, b| gs[*b].total_cmp(&gs[*a]).then(a.cmp(b)));
        s.groups.truncate(spec.topk_group);
        s.groups.sort_unstable();
        for &g in &s.groups {
            s.candidates.extend(g * per_group..(g + 1) * per_group);
        }
    }
    s.candidates.sort_by(better);
    let chosen = &s.candidates[..spec.top_k];
    for (w, &c) in weights.iter_mut().zip(chosen) {
        *w = scores[c];
    }
    if spec.norm_topk_prob {
        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
        for w in weights.iter_mut() {
            *w /= sum;
        }
    }
    for w in weights.iter_mut() {
        *w *= spec.scaling;
    }
    for (i, &c) in idx.iter_mut().zip(chosen) {
        *i = c as i64;
    }
}

/// Sum of the two largest values (the single value for a group of one).
fn top2_sum(v: &[f32]) -> f32 {
    let mut first = f32::NEG_INFINITY;
    let mut second = f32::NEG_INFINITY;
    for &x in v {
        if x.total_cmp(&first) == Ordering::Greater {
            second = first;
            first = x;
        } else if x.total_cmp(&second) == Ordering::Greater {
            second = x;
        }
    }
    if v.len() < 2 {
        first
    } else {
        first + second
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(group_score: GroupScore) -> TopkSpec {
        TopkSpec {
            num_experts: 8,
            top_k: 2,
            n_group: 4,
            topk_group: 2,
            group_score,
            norm_topk_prob: true,
            scaling: 2.0,
        }
    }

    #[test]
    fn groups_limit_the_candidates_and_ties_go_to_the_lower_id() {
        // Groups of 2: [0,1] [2,3] [4,5] [6,7]. Top-2 sums: 0.9, 1.0, 1.1, 0.2 -> groups 1, 2.
        let scores = [0.5, 0.4, 0.5, 0.5, 0.9, 0.2, 0.1, 0.1];
        let (mut idx, mut w) = ([0i64; 2], [0f32; 2]);
        let spec = spec(GroupScore::Top2Sum);
        route_topk(&scores, TopkInput::Scores, None, &spec, &mut idx, &mut w).unwrap();
        // Candidates 2..6: keys 0.5 0.5 0.9 0.2 -> 4, then 2 (tie with 3, lower id).
        assert_eq!(idx, [4, 2]);
        let sum = 0.9f32 + 0.5 + 1e-20;
        assert_eq!(w, [0.9 / sum * 2.0, 0.5 / sum * 2.0]);
    }

    #[test]
    fn bias_changes_the_choice_but_not_the_weights() {
        let scores = [0.1, 0.2, 0.3, 0.4];
        let bias = [1.0, 0.0, 0.0, 0.0];
        let spec = TopkSpec {
            num_experts: 4,
            top_k: 1,
            n_group: 1,
            topk_group: 1,
            group_score: GroupScore::None,
            norm_topk_prob: false,
            scaling: 1.0,
        };
        let (mut idx, mut w) = ([0i64; 1], [0f32; 1]);
        route_topk(
            &scores,
            TopkInput::Scores,
            Some(&bias),
            &spec,
            &mut idx,
            &mut w,
        )
        .unwrap();
        assert_eq!((idx, w), ([0], [0.1]));
    }

    #[test]
    fn logits_are_scored_before_the_selection() {
        let logits = [0.3f32, -1.0, 2.0, 0.0, -0.5, 1.5, 0.7, -2.0];
        let spec = spec(GroupScore::Top2Sum);
        let bias = [0.0f32, 0.0, -0.2, 0.1, 0.0, 0.0, 0.3, 0.0];
        // Hand-computed choices; either way the bias puts expert 2 (largest logit) second.
        // Sigmoid: groups 1 and 2 win, then 5 (0.82) before 2 (0.88 - 0.2). Softmax: groups 3
        // and 1 (6 gets 0.12 + 0.3), then 6 before 2 (0.43 - 0.2).
        for (f, score, want) in [
            (
                Scoring::Sigmoid,
                logits.map(scoring::sigmoid).to_vec(),
                [5, 2],
            ),
            (
                Scoring::Softmax,
                {
                    let mut s = vec![0f32; 8];
                    scoring::softmax(&logits, &mut s);
                    s
                },
                [6, 2],
            ),
        ] {
            let (mut idx, mut w) = ([0i64; 2], [0f32; 2]);
            let input = TopkInput::Logits(f);
            route_topk(&logits, input, Some(&bias), &spec, &mut idx, &mut w).unwrap();
            let (mut want_idx, mut want_w) = ([0i64; 2], [0f32; 2]);
            route_topk(
                &score,
                TopkInput::Scores,
                Some(&bias),
                &spec,
                &mut want_idx,
                &mut want_w,
            )
            .unwrap();
            assert_eq!(
                (idx, w.map(f32::to_bits)),
                (want_idx, want_w.map(f32::to_bits))
            );
            assert_eq!(idx, want, "{f:?}");
        }
    }

    #[test]
    fn bad_specs_name_the_field() {
        let mut s = spec(GroupScore::Max);
        s.n_group = 3;
        assert!(s.check(false).unwrap_err().to_string().contains("n_group"));
        let mut s = spec(GroupScore::Max);
        s.top_k = 5;
        assert!(s.check(false).unwrap_err().to_string().contains("top_k"));
    }
}
