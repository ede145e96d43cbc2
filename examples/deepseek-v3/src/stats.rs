//! Summaries of latency samples (mean, median, p99, max), as `generate` and `bench-serve`
//! report them. Percentiles interpolate linearly between the closest ranks (numpy's default,
//! which vLLM's benchmark uses).

use serde::Serialize;

/// The `p`-th percentile (`0..=100`) of `sorted` (ascending, not empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = (p / 100.0).clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// Mean, median, 99th percentile and maximum of a set of samples.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Summary {
    /// Arithmetic mean.
    pub mean: f64,
    /// 50th percentile.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
}

impl Summary {
    /// The summary of `samples`, or `None` when there are none.
    pub fn of(samples: &[f64]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        Some(Self {
            mean: s.iter().sum::<f64>() / s.len() as f64,
            p50: percentile(&s, 50.0),
            p99: percentile(&s, 99.0),
            max: s[s.len() - 1],
        })
    }

    /// Every value multiplied by `k` (seconds to milliseconds, say).
    pub fn scaled(self, k: f64) -> Self {
        Self {
            mean: self.mean * k,
            p50: self.p50 * k,
            p99: self.p99 * k,
            max: self.max * k,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let s = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&s, 0.0), 1.0);
        assert_eq!(percentile(&s, 50.0), 2.5);
        assert!((percentile(&s, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&s, 100.0), 4.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        let sum = Summary::of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!((sum.mean, sum.p50, sum.max), (2.5, 2.5, 4.0));
        assert!(Summary::of(&[]).is_none());
        assert_eq!(Summary::of(&[0.5]).unwrap().scaled(1e3).p99, 500.0);
    }
}
