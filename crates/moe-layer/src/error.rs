//! The MoE layer's error type.

/// Result alias of this crate's fallible constructors.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What building or running a [`crate::MoeLayer`] can fail with. Converts into
/// [`candle_core::Error`] at the `forward` boundary.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad configuration or arguments; names the argument, the value and the limit.
    #[error("invalid argument `{arg}` = {value}: {limit}")]
    InvalidArgument {
        /// The argument's name.
        arg: &'static str,
        /// The offending value.
        value: String,
        /// What it must satisfy.
        limit: String,
    },
    /// The expert-parallel runtime failed (a peer, a bad input to dispatch/combine, ...).
    #[error(transparent)]
    Runtime(#[from] ep_runtime::Error),
    /// A kernel of `ep-kernels` refused its arguments or failed to launch.
    #[error(transparent)]
    Kernel(#[from] ep_kernels::Error),
    /// A candle operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
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
}

impl Error {
    /// The rank a peer failure names, if any (a timeout, a lost or misbehaving peer).
    pub fn rank(&self) -> Option<usize> {
        match self {
            Error::Runtime(r) => r.rank(),
            _ => None,
        }
    }

    /// The layer error inside a `candle_core::Error` returned by [`crate::MoeLayer::forward`]
    /// (typed errors are wrapped, not stringified, at that border).
    pub fn from_candle(e: &candle_core::Error) -> Option<&Error> {
        match e {
            candle_core::Error::WrappedContext { wrapped, .. } => wrapped.downcast_ref::<Error>(),
            candle_core::Error::WithBacktrace { inner, .. } => Self::from_candle(inner),
            candle_core::Error::Context { inner, .. } => Self::from_candle(inner),
            _ => None,
        }
    }
}

impl From<Error> for candle_core::Error {
    /// Candle's own errors pass through; the others are wrapped, so that
    /// [`Error::from_candle`] gives them back typed (and with [`Error::rank`]).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_errors_survive_the_candle_border() {
        let e = Error::Runtime(ep_runtime::Error::Timeout {
            rank: 3,
            what: "dispatch".into(),
            waited: std::time::Duration::from_secs(1),
        });
        let c: candle_core::Error = e.into();
        let back = Error::from_candle(&c).expect("typed error inside");
        assert_eq!(back.rank(), Some(3));
        assert!(c.to_string().contains("rank 3"), "{c}");
    }
}
