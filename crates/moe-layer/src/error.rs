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

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(c) => c,
            Error::Runtime(r) => r.into(),
            other => candle_core::Error::Msg(other.to_string()),
        }
    }
}
