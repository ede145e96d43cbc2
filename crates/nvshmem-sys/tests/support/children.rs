//! One child process per rank, supervised: shared by the multi-process GPU tests of
//! nvshmem-sys (`gpu_nvshmem`) and of ep-runtime (`gpu_nvshmem_store`, through `#[path]`).

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How a child ended and what it printed.
pub struct Outcome {
    /// It exited with success.
    pub ok: bool,
    /// Its exit status, or why it has none (killed after the timeout, wait failed).
    pub status: String,
    /// Its standard output, then its standard error.
    pub text: String,
}

/// Starts `commands` (one per rank) with their output piped, drains the pipes on threads so
/// that a chatty child never blocks, and waits for every child, killing those still running
/// after `timeout`.
pub fn run_children(commands: Vec<Command>, timeout: Duration) -> Vec<Outcome> {
    let mut children: Vec<(Child, std::thread::JoinHandle<String>)> = commands
        .into_iter()
        .map(|mut cmd| {
            let mut child = cmd
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn child");
            let mut out = child.stdout.take().expect("piped stdout");
            let mut err = child.stderr.take().expect("piped stderr");
            let reader = std::thread::spawn(move || {
                let err_reader = std::thread::spawn(move || {
                    let mut s = Vec::new();
                    let _ = err.read_to_end(&mut s);
                    s
                });
                let mut s = Vec::new();
                let _ = out.read_to_end(&mut s);
                let e = err_reader.join().unwrap_or_default();
                String::from_utf8_lossy(&s).into_owned() + &String::from_utf8_lossy(&e)
            });
            (child, reader)
        })
        .collect();
    let n = children.len();
    let deadline = Instant::now() + timeout;
    let mut statuses: Vec<Option<String>> = vec![None; n];
    let mut ok = vec![false; n];
    while statuses.iter().any(Option::is_none) {
        for (i, (child, _)) in children.iter_mut().enumerate() {
            if statuses[i].is_some() {
                continue;
            }
            match child.try_wait() {
                Ok(Some(s)) => {
                    ok[i] = s.success();
                    statuses[i] = Some(format!("{s}"));
                }
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    statuses[i] = Some(format!("killed after {timeout:?} (hung)"));
                }
                Ok(None) => {}
                Err(e) => statuses[i] = Some(format!("wait failed: {e}")),
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    children
        .into_iter()
        .zip(statuses)
        .zip(ok)
        .map(|(((_, reader), status), ok)| Outcome {
            ok,
            status: status.unwrap_or_default(),
            text: reader.join().unwrap_or_default(),
        })
        .collect()
}

/// A test case's result: `Err` holds why it failed.
pub type TestResult = std::result::Result<(), String>;

/// The parent's count of passed and failed cases, its own and its children's.
#[derive(Default)]
pub struct Tally {
    passed: usize,
    failed: usize,
}

impl Tally {
    /// Prints and counts one case of the parent.
    pub fn record(&mut self, name: &str, result: TestResult) {
        match result {
            Ok(()) => {
                self.passed += 1;
                println!("PASS {name}");
            }
            Err(e) => {
                self.failed += 1;
                println!("FAIL {name}: {e}");
            }
        }
    }

    /// Prints child `rank` of `launch` and counts its `PASS ` / `FAIL ` lines; a child that
    /// failed without a `FAIL ` line counts as one failed case.
    pub fn child(&mut self, launch: &str, rank: usize, outcome: &Outcome) {
        println!(
            "===== {launch}: rank {rank} ({}) =====\n{}",
            outcome.status, outcome.text
        );
        let lines = |p: &str| outcome.text.lines().filter(|l| l.starts_with(p)).count();
        let (p, f) = (lines("PASS "), lines("FAIL "));
        self.passed += p;
        self.failed += f;
        if !outcome.ok && f == 0 {
            self.record(
                &format!("{launch}/rank_{rank}_exit"),
                Err(outcome.status.clone()),
            );
        }
    }

    /// Prints `N passed, M failed` and exits, non-zero if any case failed or none ran
    /// (`gpu-test-suite`'s rule).
    pub fn finish(&self) -> ! {
        gpu_test_suite::finish(self.passed, self.failed)
    }

    /// Ends the binary when its GPU cases cannot run here (`reason`): the parent's own cases
    /// are counted, but the suite fails unless `EP_GPU_ALLOW_SKIP=1` says skipping is fine.
    pub fn skip(&self, reason: &str) -> ! {
        println!("skipping the GPU cases: {reason}");
        println!("{} passed, {} failed", self.passed, self.failed);
        let allow = gpu_test_suite::skip_allowed();
        std::process::exit(gpu_test_suite::exit_code(0, self.failed, allow))
    }
}

/// Sets, before any thread exists, what the children inherit: NVLink multicast (NVLS) off, as
/// on every machine here, and NVSHMEM over NVLink alone with its bootstrap on the loopback
/// interface unless the caller chose otherwise.
pub fn nvshmem_environment() {
    std::env::set_var("NVSHMEM_DISABLE_NVLS", "1");
    for (var, value) in [
        ("NVSHMEM_REMOTE_TRANSPORT", "none"),
        ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo"),
    ] {
        if std::env::var_os(var).is_none() {
            std::env::set_var(var, value);
        }
    }
}

/// Loads NVSHMEM (a failure to load is a failed case, and the end) and returns the children to
/// start, one per visible GPU (at most 8, fewer with `EP_NVSHMEM_WORLD`), and their timeout
/// (`EP_NVSHMEM_TIMEOUT` seconds, default 120); without a usable GPU it ends the run.
pub fn world_of_visible_gpus(tally: &mut Tally) -> (usize, Duration) {
    use nvshmem_sys::Error;
    let gpus = match nvshmem_sys::cuda_device_count() {
        Ok(n) => n,
        Err(
            e @ (Error::LibraryNotFound { .. }
            | Error::LibraryNotInDir { .. }
            | Error::Load { .. }
            | Error::ShimFile { .. }
            | Error::AbiMismatch { .. }),
        ) => {
            tally.record("parent/load_nvshmem", Err(e.to_string()));
            tally.finish();
        }
        Err(e) => {
            tally.record("parent/load_nvshmem", Ok(()));
            tally.skip(&format!("no usable CUDA device ({e})"));
        }
    };
    tally.record("parent/load_nvshmem", Ok(()));
    if gpus == 0 {
        tally.skip("no CUDA device visible");
    }
    let world = std::env::var("EP_NVSHMEM_WORLD")
        .ok()
        .and_then(|w| w.parse::<usize>().ok())
        .filter(|&w| w >= 1)
        .unwrap_or(gpus)
        .min(gpus)
        .min(8);
    let timeout = Duration::from_secs(
        std::env::var("EP_NVSHMEM_TIMEOUT")
            .ok()
            .and_then(|t| t.parse().ok())
            .unwrap_or(120),
    );
    (world, timeout)
}

/// Prints one case of child `rank` of `launch` as [`Tally::child`] counts it (and flushes, so
/// that a later hang still shows it); returns whether it failed.
pub fn print_case(launch: &str, rank: usize, name: &str, result: TestResult) -> bool {
    let failed = match result {
        Ok(()) => {
            println!("PASS {launch}/{name} (rank {rank})");
            false
        }
        Err(e) => {
            println!("FAIL {launch}/{name} (rank {rank}): {e}");
            true
        }
    };
    let _ = std::io::Write::flush(&mut std::io::stdout());
    failed
}
