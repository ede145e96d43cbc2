//! The device properties the launchers size their grids with.

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::CudaContext;

use crate::error::Result;

/// Device properties the launchers size their grids with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceProps {
    /// The device ordinal.
    pub ordinal: usize,
    /// Number of streaming multiprocessors.
    pub sm_count: u32,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Largest block, in threads.
    pub max_threads_per_block: u32,
    /// Largest dynamic + static shared memory per block after opting in, in bytes.
    pub max_smem_per_block_optin: u32,
    /// L2 cache size in bytes.
    pub l2_cache_bytes: u32,
    /// Peak DRAM bandwidth in GB/s (memory clock x bus width x 2; 0 when the driver does not
    /// report the clock).
    pub peak_memory_gbs: u32,
    /// Whether cooperative (grid-synchronising) launches are supported.
    pub cooperative_launch: bool,
}

impl DeviceProps {
    /// The properties of `ctx`'s device.
    pub(crate) fn query(ctx: &CudaContext) -> Result<Self> {
        let attr = |a: CUdevice_attribute| -> Result<u32> {
            let v = ctx.attribute(a)?;
            Ok(u32::try_from(v).unwrap_or(0))
        };
        Ok(Self {
            ordinal: ctx.ordinal(),
            sm_count: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            compute_capability: ctx.compute_capability()?,
            max_threads_per_block: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
            )?,
            max_smem_per_block_optin: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )?,
            l2_cache_bytes: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?,
            peak_memory_gbs: {
                // kHz x bits x 2 (double data rate) / 8 bits per byte, in GB/s.
                let khz = u64::from(attr(
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE,
                )?);
                let bits = u64::from(attr(
                    CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH,
                )?);
                u32::try_from(khz * bits / 4 / 1_000_000).unwrap_or(u32::MAX)
            },
            cooperative_launch: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)?
                != 0,
        })
    }
}
