//! How a GPU test binary (`harness = false`) runs its cases and ends, one rule for all of
//! them: one line per case, `N passed, N failed` last, and exit code 1 when a case failed or
//! when none ran (no GPU, too few GPUs, a filter that matched nothing) unless
//! [`ALLOW_SKIP`]`=1` says that skipping is fine where the binary runs. A suite that ran
//! nothing has not passed.

use std::error::Error;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

/// The variable that lets a binary that ran no case exit 0 (`EP_GPU_ALLOW_SKIP=1`).
pub const ALLOW_SKIP: &str = "EP_GPU_ALLOW_SKIP";

/// What a case returns: any error fails it, with its message printed.
pub type CaseResult = Result<(), Box<dyn Error>>;

/// The exit code of a binary whose cases gave `passed` and `failed`.
pub fn exit_code(passed: usize, failed: usize, allow_skip: bool) -> i32 {
    if failed > 0 || (passed == 0 && !allow_skip) {
        1
    } else {
        0
    }
}

/// Whether [`ALLOW_SKIP`] is set to `1`.
pub fn skip_allowed() -> bool {
    std::env::var(ALLOW_SKIP).is_ok_and(|v| v == "1")
}

/// Prints `N passed, N failed` (and why, when no case ran) and exits with [`exit_code`].
pub fn finish(passed: usize, failed: usize) -> ! {
    println!("{passed} passed, {failed} failed");
    let allow = skip_allowed();
    if passed + failed == 0 {
        if allow {
            println!("no case ran; {ALLOW_SKIP}=1 allows that");
        } else {
            println!("no case ran, which fails the suite ({ALLOW_SKIP}=1 allows it)");
        }
    }
    std::process::exit(exit_code(passed, failed, allow));
}

/// Ends a binary that cannot run its cases here (`reason`, e.g. no GPU): no case ran.
pub fn skip(reason: &str) -> ! {
    println!("skipping: {reason}");
    finish(0, 0)
}

/// Named cases, run one after another, filtered by the binary's first argument.
#[derive(Debug)]
pub struct Suite {
    filter: Option<String>,
    passed: usize,
    failed: usize,
}

impl Suite {
    /// A suite filtered by the first command-line argument that is not a flag, if any (only
    /// cases whose name contains it run).
    pub fn from_args() -> Self {
        Self::with_filter(std::env::args().skip(1).find(|a| !a.starts_with('-')))
    }

    /// A suite running only cases whose name contains `filter` (all with `None`).
    pub fn with_filter(filter: Option<String>) -> Self {
        Self {
            filter,
            passed: 0,
            failed: 0,
        }
    }

    /// The name filter, if any.
    pub fn filter(&self) -> Option<&str> {
        self.filter.as_deref()
    }

    /// Whether case `name` runs under the filter.
    pub fn selects(&self, name: &str) -> bool {
        self.filter.as_deref().is_none_or(|f| name.contains(f))
    }

    /// Runs `f` as case `name` unless filtered out; an error or a panic fails it. Prints one
    /// line either way.
    pub fn run(&mut self, name: &str, f: impl FnOnce() -> CaseResult) {
        if !self.selects(name) {
            return;
        }
        let start = Instant::now();
        let outcome = catch_unwind(AssertUnwindSafe(f));
        let ms = start.elapsed().as_secs_f64() * 1e3;
        match outcome {
            Ok(Ok(())) => {
                self.passed += 1;
                println!("ok     {name} ({ms:.1} ms)");
            }
            Ok(Err(e)) => {
                self.failed += 1;
                println!("FAILED {name} ({ms:.1} ms): {e}");
            }
            Err(panic) => {
                self.failed += 1;
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_else(|| "panic".into());
                println!("FAILED {name} ({ms:.1} ms): panicked: {msg}");
            }
        }
    }

    /// Counts cases run elsewhere (child processes, which printed their own lines).
    pub fn add_counts(&mut self, passed: usize, failed: usize) {
        self.passed += passed;
        self.failed += failed;
    }

    /// `(passed, failed)` so far.
    pub fn counts(&self) -> (usize, usize) {
        (self.passed, self.failed)
    }

    /// Ends the binary ([`finish`]).
    pub fn finish(self) -> ! {
        finish(self.passed, self.failed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_suite_that_ran_nothing_fails_unless_skipping_is_allowed() {
        assert_eq!(exit_code(3, 0, false), 0);
        assert_eq!(exit_code(3, 1, true), 1);
        assert_eq!(exit_code(0, 0, false), 1);
        assert_eq!(exit_code(0, 0, true), 0);
        assert_eq!(exit_code(0, 2, true), 1);
    }

    #[test]
    fn cases_count_errors_and_panics_as_failures_and_filters_apply() {
        let mut s = Suite::with_filter(Some("keep".into()));
        s.run("keep/ok", || Ok(()));
        s.run("keep/err", || Err("no".into()));
        s.run("keep/panic", || panic!("boom"));
        s.run("other", || Err("never run".into()));
        assert_eq!(s.counts(), (1, 2));
        assert!(s.selects("keep/x") && !s.selects("drop"));
        s.add_counts(2, 0);
        assert_eq!(s.counts(), (3, 2));
    }
}
