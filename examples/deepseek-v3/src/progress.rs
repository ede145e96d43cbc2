//! Progress of long steps (loading layers, writing a checkpoint) on stderr: a bar when stderr is
//! a terminal; otherwise (a rank under `launch`, whose stderr is the launcher's pipe, or a log
//! file) a plain line every few seconds and one at the end, and nothing for steps that finish
//! within those seconds.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// How often the line form reports.
const LINE_EVERY: Duration = Duration::from_secs(2);

enum Sink {
    Hidden,
    Bar(ProgressBar),
    Lines { last: Instant, printed: bool },
}

/// A progress report over `len` units of work.
pub struct Progress {
    sink: Sink,
    what: String,
    unit: &'static str,
    len: u64,
    pos: u64,
    start: Instant,
}

impl Progress {
    /// Reports `what` (e.g. "loading /models/x") over `len` `unit`s; silent unless `visible`.
    pub fn new(what: impl Into<String>, len: u64, unit: &'static str, visible: bool) -> Self {
        let what = what.into();
        let sink = if !visible {
            Sink::Hidden
        } else if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(len);
            let template = format!("{{msg}} [{{bar:30}}] {{pos}}/{{len}} {unit} ({{elapsed}})");
            bar.set_style(
                ProgressStyle::with_template(&template)
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar.set_message(what.clone());
            Sink::Bar(bar)
        } else {
            Sink::Lines {
                last: Instant::now(),
                printed: false,
            }
        };
        Self {
            sink,
            what,
            unit,
            len,
            pos: 0,
            start: Instant::now(),
        }
    }

    /// `n` more units are done.
    pub fn inc(&mut self, n: u64) {
        self.pos += n;
        match &mut self.sink {
            Sink::Hidden => {}
            Sink::Bar(bar) => bar.inc(n),
            Sink::Lines { last, printed } => {
                if last.elapsed() >= LINE_EVERY {
                    *last = Instant::now();
                    *printed = true;
                    let _ = writeln!(
                        std::io::stderr(),
                        "{}: {}/{} {} ({:.1} s)",
                        self.what,
                        self.pos,
                        self.len,
                        self.unit,
                        self.start.elapsed().as_secs_f64()
                    );
                }
            }
        }
    }

    /// The work is done: clears the bar, or reports the total time if lines were printed.
    pub fn finish(self) {
        match self.sink {
            Sink::Hidden => {}
            Sink::Bar(bar) => bar.finish_and_clear(),
            Sink::Lines { printed, .. } => {
                if printed || self.start.elapsed() >= LINE_EVERY {
                    let _ = writeln!(
                        std::io::stderr(),
                        "{}: done, {} {} in {:.1} s",
                        self.what,
                        self.pos,
                        self.unit,
                        self.start.elapsed().as_secs_f64()
                    );
                }
            }
        }
    }
}
