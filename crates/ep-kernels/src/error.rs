//! Errors of the kernel layer.

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a kernel or its host twin rejects, before anything runs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An argument is out of range; names the argument, the value and the limit.
    #[error("invalid argument `{arg}` = {value}: {limit}")]
    InvalidArgument {
        /// The argument's name.
        arg: &'static str,
        /// The offending value.
        value: String,
        /// What it must satisfy.
        limit: String,
    },
    /// A slice has the wrong length.
    #[error("length mismatch for `{arg}`: expected {expected}, got {got}")]
    Length {
        /// The argument's name.
        arg: &'static str,
        /// Expected number of elements.
        expected: usize,
        /// Given number of elements.
        got: usize,
    },
    /// A CUDA driver call failed.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] cudarc::driver::DriverError),
    /// A cuBLAS call failed.
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cublas(#[from] cudarc::cublas::result::CublasError),
    /// A kernel of the host library (CUTLASS) refused its arguments or failed to launch.
    #[cfg(feature = "cuda")]
    #[error("kernel `{kernel}` failed: {message}")]
    Launch {
        /// The kernel.
        kernel: &'static str,
        /// What its entry point reported.
        message: String,
    },
    /// An NVSHMEM call (symmetric memory, module binding) failed.
    #[cfg(feature = "nvshmem")]
    #[error(transparent)]
    Nvshmem(#[from] nvshmem_sys::Error),
    /// A kernel reported that a peer never signalled within the timeout.
    #[error("timed out waiting for rank {rank} in kernel `{kernel}`")]
    PeerTimeout {
        /// The rank that did not signal.
        rank: usize,
        /// The kernel that waited.
        kernel: &'static str,
    },
    /// A dispatch into worst-case outputs found a rank receiving more rows than they hold;
    /// every rank stopped before moving anything.
    #[error(
        "rank {rank} receives {received} tokens, more than the {capacity} rows of the \
         worst-case outputs (num_worst_tokens)"
    )]
    RecvCapacity {
        /// The rank that would have overflowed.
        rank: usize,
        /// The tokens it receives.
        received: usize,
        /// The rows sized for it.
        capacity: usize,
    },
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

    /// Checks `got == expected` for the slice `arg`.
    pub fn check_len(arg: &'static str, expected: usize, got: usize) -> Result<()> {
        if expected == got {
            Ok(())
        } else {
            Err(Self::Length { arg, expected, got })
        }
    }

    /// Checks every `(arg, expected, got)` length of the tensors of one shape; the first that
    /// differs is an [`Error::InvalidArgument`] saying what it must hold for `shape` (the
    /// shape in words).
    pub fn check_lens(
        lens: &[(&'static str, usize, usize)],
        shape: impl std::fmt::Display,
    ) -> Result<()> {
        match lens.iter().find(|(_, want, got)| want != got) {
            None => Ok(()),
            Some(&(arg, want, got)) => Err(Self::invalid(
                arg,
                format!("{got} values"),
                format!("must hold {want} for {shape}"),
            )),
        }
    }
}
