//! The runtime's error type.

use std::time::Duration;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the EP runtime.
///
/// Messages name the argument, the value and the limit (bad input), or the rank and what was
/// awaited (communication), so a failure in a 64-rank job points at its cause.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An argument is out of range or inconsistent; nothing was sent.
    #[error("invalid argument `{arg}` = {value}: {limit}")]
    InvalidArgument {
        /// The argument's name.
        arg: &'static str,
        /// The offending value, printed.
        value: String,
        /// What it must satisfy.
        limit: String,
    },
    /// A tensor has the wrong shape.
    #[error("shape mismatch for `{arg}`: expected {expected}, got {got:?}")]
    Shape {
        /// The argument's name.
        arg: &'static str,
        /// The expected shape, in words (e.g. `[num_tokens, 7168]`).
        expected: String,
        /// The shape given.
        got: Vec<usize>,
    },
    /// A tensor has the wrong dtype.
    #[error("dtype mismatch for `{arg}`: expected {expected}, got {got:?}")]
    DType {
        /// The argument's name.
        arg: &'static str,
        /// The accepted dtypes, in words.
        expected: &'static str,
        /// The dtype given.
        got: candle_core::DType,
    },
    /// A handle was passed to an op it does not belong to.
    #[error("handle mismatch: {0}")]
    HandleMismatch(String),

    /// A dispatch into worst-case outputs ([`DispatchArgs::num_worst_tokens`]) found a rank
    /// receiving more tokens than they hold; nothing was moved.
    ///
    /// [`DispatchArgs::num_worst_tokens`]: crate::DispatchArgs::num_worst_tokens
    #[error("rank {rank} receives {received} tokens, more than num_worst_tokens = {capacity}")]
    RecvCapacity {
        /// The rank that would have overflowed.
        rank: usize,
        /// The tokens it receives.
        received: usize,
        /// The worst case given.
        capacity: usize,
    },
    /// A peer did not answer in time.
    #[error("timed out after {waited:?} waiting for rank {rank} ({what})")]
    Timeout {
        /// The rank that did not answer.
        rank: usize,
        /// What was awaited.
        what: String,
        /// How long we waited.
        waited: Duration,
    },
    /// A peer's connection closed (the process or thread is gone).
    #[error("rank {rank} is gone: {what}")]
    PeerLost {
        /// The rank that is gone.
        rank: usize,
        /// What we were doing when we noticed.
        what: String,
    },
    /// Another rank failed a collective setup step and told the others through the bootstrap
    /// store, so this rank stopped too instead of waiting for it (its own error is in its log).
    #[error("rank {rank} could not {what}: {reason}")]
    PeerFailed {
        /// The rank that failed (the lowest, if several did).
        rank: usize,
        /// The step, in words.
        what: String,
        /// What that rank reported.
        reason: String,
    },
    /// Some ranks were masked out of a low-latency op (timed out now or earlier); the op
    /// completed with their contributions treated as zero.
    #[error("ranks {ranks:?} are inactive (masked); their contributions were treated as zero")]
    RanksMasked {
        /// The inactive ranks.
        ranks: Vec<usize>,
    },
    /// This rank's collectives were cancelled for a failure agreement
    /// ([`crate::Buffer::cancel_collectives`]): another rank saw a peer fail.
    #[error("cancelled: another rank is agreeing on a failed rank; {what} broke off")]
    Cancelled {
        /// The collective that broke off.
        what: String,
    },
    /// The other ranks agreed that this rank is lost (it did not check in to their agreement
    /// within the timeout, e.g. it was stalled): it must leave the job.
    #[error(
        "the other ranks found rank {rank} lost (it did not answer within the timeout); it must \
         leave the job"
    )]
    FoundLost {
        /// This rank.
        rank: usize,
    },
    /// The bootstrap store failed.
    #[error("bootstrap store: {0}")]
    Store(String),
    /// A socket or file operation failed.
    #[error("i/o error ({context}): {source}")]
    Io {
        /// What we were doing.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A message from a peer could not be decoded.
    #[error("protocol error from rank {rank}: {what}")]
    Protocol {
        /// The peer.
        rank: usize,
        /// What was wrong.
        what: String,
    },
    /// A candle operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A kernel-level error.
    #[error(transparent)]
    Kernel(#[from] ep_kernels::Error),
    /// A CUDA driver call failed.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] cudarc::driver::DriverError),
    /// An NVSHMEM call failed (feature `nvshmem`).
    #[cfg(feature = "nvshmem")]
    #[error(transparent)]
    Nvshmem(#[from] nvshmem_sys::Error),
    /// The requested operation is not available on this backend.
    #[error("unsupported: {0}")]
    Unsupported(String),
}

impl Error {
    /// Builds an [`Error::InvalidArgument`].
    pub fn invalid(
        arg: &'static str,
        value: impl std::fmt::Display,
        limit: impl Into<String>,
    ) -> Self {
        Self::InvalidArgument {
            arg,
            value: value.to_string(),
            limit: limit.into(),
        }
    }

    /// Builds an [`Error::Io`].
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    /// The rank this error blames, if any.
    pub fn rank(&self) -> Option<usize> {
        match self {
            Self::Timeout { rank, .. }
            | Self::PeerLost { rank, .. }
            | Self::PeerFailed { rank, .. }
            | Self::FoundLost { rank }
            | Self::Protocol { rank, .. } => Some(*rank),
            Self::RanksMasked { ranks } => ranks.first().copied(),
            _ => None,
        }
    }
}

impl From<Error> for candle_core::Error {
    /// Candle's own errors pass through; the others are wrapped (not stringified), so a caller
    /// holding a `candle_core::Error` gets the typed error back with [`Error::from_candle`].
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(c) => c,
            other => {
                let context = other.to_string();
                candle_core::Error::WrappedContext {
                    wrapped: Box::new(other),
                    context,
                }
            }
        }
    }
}

impl Error {
    /// The runtime error inside a `candle_core::Error` made from one (see the `From` impl),
    /// looking through candle's context layers.
    pub fn from_candle(e: &candle_core::Error) -> Option<&Error> {
        match e {
            candle_core::Error::WrappedContext { wrapped, .. } => wrapped.downcast_ref::<Error>(),
            candle_core::Error::WithBacktrace { inner, .. } => Self::from_candle(inner),
            candle_core::Error::Context { inner, .. } => Self::from_candle(inner),
            _ => None,
        }
    }
}
