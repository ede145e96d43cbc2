//! Launching one kernel with one by-value `#[repr(C)]` parameter struct.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{
    CUdeviceptr, CUfunctionLoadingState, CUfunction_attribute, CUlaunchAttribute,
    CUlaunchAttributeID, CUlaunchConfig,
};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};

use super::device_props::DeviceProps;
use crate::error::{Error, Result};

/// Dynamic shared memory a block may use without opting in, in bytes.
pub const DEFAULT_DYNAMIC_SMEM_LIMIT: u32 = 48 * 1024;

/// A `#[repr(C)]` struct that a kernel takes as its only parameter, by value.
///
/// # Safety
///
/// The implementor must be `#[repr(C)]` with exactly the layout of the `.cu` side's params
/// struct (same field order, types and size; device pointers as [`CUdeviceptr`] / `u64`), and
/// must hold no Rust references or other non-plain-data fields.
pub unsafe trait KernelParams: Copy + Send + Sync + 'static {}

/// Pins the layout of a [`KernelParams`] mirror at compile time to that of the `.cu` side's
/// struct: its size, then the byte offset of each listed field (`field = offset`), so that a
/// field moved, resized or swapped with another fails the build, not the kernel.
macro_rules! assert_params_layout {
    ($ty:ty, $size:expr; $($field:ident = $offset:expr),+ $(,)?) => {
        const _: () = assert!(::std::mem::size_of::<$ty>() == $size);
        $(const _: () = assert!(::std::mem::offset_of!($ty, $field) == $offset);)+
    };
}
pub(crate) use assert_params_layout;

/// The params struct as a kernel argument: `cuLaunchKernel` copies `size_of::<P>()` bytes from
/// its address, which is what the kernel's by-value parameter expects.
#[repr(transparent)]
struct ByValue<P>(P);

// SAFETY: `ByValue<P>` is `repr(transparent)` over a `KernelParams` type, whose implementor
// guarantees a plain-data `repr(C)` layout identical to the kernel's parameter.
unsafe impl<P: KernelParams> DeviceRepr for ByValue<P> {}

/// One loaded kernel: a function of an embedded cubin, bound to one context.
#[derive(Debug)]
pub struct Kernel {
    file: String,
    name: String,
    function: CudaFunction,
    ctx: Arc<CudaContext>,
    props: DeviceProps,
    /// The dynamic shared-memory limit set on the function so far (starts at the default).
    smem_limit: AtomicU32,
}

impl Kernel {
    pub(super) fn new(
        file: &str,
        name: &str,
        function: CudaFunction,
        ctx: Arc<CudaContext>,
        props: DeviceProps,
    ) -> Self {
        Self {
            file: file.to_owned(),
            name: name.to_owned(),
            function,
            ctx,
            props,
            smem_limit: AtomicU32::new(DEFAULT_DYNAMIC_SMEM_LIMIT),
        }
    }

    /// The cubin this kernel comes from (e.g. `"layout/layout"`).
    pub fn file(&self) -> &str {
        &self.file
    }

    /// The kernel's symbol.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The underlying cudarc function (for occupancy queries and attributes).
    pub fn function(&self) -> &CudaFunction {
        &self.function
    }

    /// Loads the function into its context now (`cuFuncLoad`; a no-op once loaded), so that no
    /// launch is the one that loads it under lazy module loading.
    pub fn load(&self) -> Result<()> {
        self.ctx.bind_to_thread()?;
        // SAFETY: the function handle belongs to a module of `self.ctx`, which `self.function`
        // keeps loaded; cuFuncLoad only loads the function.
        unsafe { cudarc::driver::sys::cuFuncLoad(self.function.cu_function()) }.result()?;
        Ok(())
    }

    /// Whether the function is loaded into its context (`cuFuncIsLoaded`).
    pub fn is_loaded(&self) -> Result<bool> {
        let mut state = CUfunctionLoadingState::CU_FUNCTION_LOADING_STATE_UNLOADED;
        // SAFETY: as in `load`; the driver writes the loading state into `state`.
        unsafe { cudarc::driver::sys::cuFuncIsLoaded(&mut state, self.function.cu_function()) }
            .result()?;
        Ok(state == CUfunctionLoadingState::CU_FUNCTION_LOADING_STATE_LOADED)
    }

    /// Properties of the device this kernel is loaded on.
    pub fn props(&self) -> &DeviceProps {
        &self.props
    }

    /// Allows launches with up to `bytes` of dynamic shared memory (a no-op below the current
    /// limit). Fails if `bytes` exceeds the device's opt-in maximum.
    pub fn reserve_dynamic_smem(&self, bytes: u32) -> Result<()> {
        if bytes <= self.smem_limit.load(Ordering::Acquire) {
            return Ok(());
        }
        if bytes > self.props.max_smem_per_block_optin {
            return Err(Error::invalid(
                "shared_mem_bytes",
                bytes,
                format!(
                    "kernel `{}` may use at most {} bytes of shared memory per block on device {}",
                    self.name, self.props.max_smem_per_block_optin, self.props.ordinal
                ),
            ));
        }
        self.ctx.bind_to_thread()?;
        let value = i32::try_from(bytes).unwrap_or(i32::MAX);
        self.function.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            value,
        )?;
        self.smem_limit.fetch_max(bytes, Ordering::AcqRel);
        Ok(())
    }

    /// Checks a launch shape against the device limits and this kernel's context.
    fn check(&self, stream: &CudaStream, cfg: &LaunchConfig) -> Result<()> {
        if stream.context().cu_ctx() != self.ctx.cu_ctx() {
            return Err(Error::invalid(
                "stream",
                format!("a stream of device {}", stream.context().ordinal()),
                format!(
                    "kernel `{}` is loaded on device {}: launch it on a stream of that context",
                    self.name, self.props.ordinal
                ),
            ));
        }
        let (gx, gy, gz) = cfg.grid_dim;
        if gx == 0 || gy == 0 || gz == 0 || gx > i32::MAX as u32 || gy > 65_535 || gz > 65_535 {
            return Err(Error::invalid(
                "grid_dim",
                format!("{:?}", cfg.grid_dim),
                "each dimension must be >= 1; x <= 2^31 - 1, y and z <= 65535",
            ));
        }
        let (bx, by, bz) = cfg.block_dim;
        let threads = u64::from(bx) * u64::from(by) * u64::from(bz);
        if threads == 0 || threads > u64::from(self.props.max_threads_per_block) {
            return Err(Error::invalid(
                "block_dim",
                format!("{:?}", cfg.block_dim),
                format!(
                    "a block must have 1 to {} threads",
                    self.props.max_threads_per_block
                ),
            ));
        }
        self.reserve_dynamic_smem(cfg.shared_mem_bytes)
    }

    /// Launches the kernel on `stream` with `params` as its single by-value parameter.
    ///
    /// # Safety
    ///
    /// `P` must be the params type of this kernel, and every device pointer in `params` must
    /// point into allocations of this context that stay alive, and are not accessed by the
    /// host or other streams in a conflicting way, until the kernel has finished on `stream`,
    /// with at least as many elements as the kernel reads or writes through it.
    pub unsafe fn launch<P: KernelParams>(
        &self,
        stream: &CudaStream,
        cfg: LaunchConfig,
        params: P,
    ) -> Result<()> {
        self.check(stream, &cfg)?;
        let arg = ByValue(params);
        let mut builder = stream.launch_builder(&self.function);
        builder.arg(&arg);
        // SAFETY: the caller guarantees that `params` matches the kernel's parameter and that
        // its pointers are valid for the launch; `arg` outlives the call, which copies it.
        unsafe { builder.launch(cfg) }?;
        Ok(())
    }

    /// Like [`Kernel::launch`], with programmatic dependent launch
    /// (`CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`): the kernel's blocks may start
    /// before the kernel before it on `stream` has finished, once that kernel's blocks have all
    /// run `griddepcontrol.launch_dependents` (or exited). On a device below compute capability
    /// 9.0 it is a plain launch.
    ///
    /// # Safety
    ///
    /// As for [`Kernel::launch`], and the kernel must run `griddepcontrol.wait` (which returns
    /// once the kernel before it has finished and its writes are visible) before it reads
    /// memory that kernel may write, or writes memory that kernel may read or write; before the
    /// wait it may read only what no kernel of the stream writes.
    pub unsafe fn launch_dependent<P: KernelParams>(
        &self,
        stream: &CudaStream,
        cfg: LaunchConfig,
        params: P,
    ) -> Result<()> {
        if self.props.compute_capability.0 < 9 {
            // SAFETY: the caller's guarantees cover a plain launch.
            return unsafe { self.launch(stream, cfg, params) };
        }
        self.check(stream, &cfg)?;
        self.ctx.bind_to_thread()?;
        let mut arg = ByValue(params);
        let mut args = [(&mut arg as *mut ByValue<P>).cast::<std::ffi::c_void>()];
        let mut attr = CUlaunchAttribute {
            id: CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            // SAFETY: an all-zero union is a valid value of each of its plain-data members.
            value: unsafe { std::mem::zeroed() },
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: `config` and its one attribute outlive the call, which copies them; `args`
        // holds the address of the by-value params struct, which the caller guarantees matches
        // the kernel's one parameter (the driver copies it at the call); the function belongs
        // to this context, bound above.
        unsafe {
            cudarc::driver::sys::cuLaunchKernelEx(
                &config,
                self.function.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()?;
        Ok(())
    }

    /// Like [`Kernel::launch`], as a cooperative launch (`cuLaunchCooperativeKernel`): every
    /// block is resident at once, so the kernel may synchronise the whole grid. The grid must
    /// fit on the device (see [`CudaFunction::occupancy_max_active_blocks_per_multiprocessor`]).
    ///
    /// # Safety
    ///
    /// As for [`Kernel::launch`].
    pub unsafe fn launch_cooperative<P: KernelParams>(
        &self,
        stream: &CudaStream,
        cfg: LaunchConfig,
        params: P,
    ) -> Result<()> {
        if !self.props.cooperative_launch {
            return Err(Error::invalid(
                "launch",
                "cooperative",
                format!(
                    "device {} does not support cooperative launches",
                    self.props.ordinal
                ),
            ));
        }
        self.check(stream, &cfg)?;
        let arg = ByValue(params);
        let mut builder = stream.launch_builder(&self.function);
        builder.arg(&arg);
        // SAFETY: as in `launch`; the grid size is checked by the driver, which fails the
        // launch (no hang) if the blocks cannot all be resident.
        unsafe { builder.launch_cooperative(cfg) }?;
        Ok(())
    }
}

/// `value` as the `i32` a params struct holds, or an error naming `arg`.
pub(crate) fn to_i32(arg: &'static str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| Error::invalid(arg, value, "must fit in an i32"))
}

/// Checks that the device pointer of argument `arg` is aligned to `align` bytes (vectorised
/// kernels need it; views at odd offsets break it).
pub fn check_align(arg: &'static str, ptr: CUdeviceptr, align: u64) -> Result<()> {
    if align != 0 && ptr % align != 0 {
        return Err(Error::invalid(
            arg,
            format!("device pointer {ptr:#x}"),
            format!("must be {align}-byte aligned"),
        ));
    }
    Ok(())
}

/// Number of blocks for `work_items` items at `items_per_block` each, capped at
/// `blocks_per_sm * sm_count` (grid-stride kernels loop over the rest); at least 1.
pub fn grid_for(
    work_items: u64,
    items_per_block: u64,
    props: &DeviceProps,
    blocks_per_sm: u32,
) -> u32 {
    let needed = work_items.div_ceil(items_per_block.max(1));
    let cap = u64::from(props.sm_count.max(1)) * u64::from(blocks_per_sm.max(1));
    u32::try_from(needed.clamp(1, cap)).unwrap_or(u32::MAX)
}

/// Allocates `len` (at least one) elements on `stream` without initialising them: for kernel
/// outputs written before they are read (the caller guarantees it; reading an unwritten element
/// reads whatever the memory held). Freed in `stream` order when dropped.
pub fn alloc_uninit<T: cudarc::driver::DeviceRepr>(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    len: usize,
) -> Result<cudarc::driver::CudaSlice<T>> {
    // SAFETY: a fresh device allocation; `T: DeviceRepr` is plain data for which any bit
    // pattern is a value, and the callers only read elements after kernels wrote them.
    Ok(unsafe { stream.alloc::<T>(len.max(1)) }?)
}

/// Sets every byte of `dst` to `byte` on `stream` (asynchronous, capturable in a CUDA graph;
/// e.g. `0xff` makes every i32 `-1`).
pub fn fill_bytes_cuda<T>(
    stream: &cudarc::driver::CudaStream,
    dst: &mut impl cudarc::driver::DevicePtrMut<T>,
    byte: u8,
) -> Result<()> {
    let bytes = dst.len() * std::mem::size_of::<T>();
    if bytes == 0 {
        return Ok(());
    }
    stream.context().bind_to_thread()?;
    let (ptr, _guard) = dst.device_ptr_mut(stream);
    // SAFETY: `ptr` addresses `bytes` bytes of `dst`, borrowed mutably until the memset is
    // queued (the guard keeps cudarc's stream ordering); `stream` is a live stream of the
    // bound context.
    unsafe { cudarc::driver::result::memset_d8_async(ptr, byte, bytes, stream.cu_stream()) }?;
    Ok(())
}

/// Sets every element of `dst` to `value` on `stream` (asynchronous, capturable in a CUDA
/// graph: a memset node, e.g. the host-known row count of a grouped GEMM's extra groups).
pub fn fill_i32_cuda(
    stream: &cudarc::driver::CudaStream,
    dst: &mut impl cudarc::driver::DevicePtrMut<i32>,
    value: i32,
) -> Result<()> {
    let n = dst.len();
    if n == 0 {
        return Ok(());
    }
    stream.context().bind_to_thread()?;
    let (ptr, _guard) = dst.device_ptr_mut(stream);
    // SAFETY: `ptr` addresses `n` 4-byte elements of `dst` (4-byte aligned as any i32
    // allocation), borrowed mutably until the memset is queued (the guard keeps cudarc's stream
    // ordering); `stream` is a live stream of the bound context.
    unsafe {
        cudarc::driver::sys::cuMemsetD32Async(ptr, value as u32, n, stream.cu_stream()).result()
    }?;
    Ok(())
}

/// Keeps the memory that stream-ordered frees return in the device's current memory pool
/// instead of handing it back to the driver at every synchronisation (the pool's release
/// threshold becomes unlimited). Without it, a step that allocates hundreds of megabytes (a
/// low-latency receive buffer, the grouped GEMMs' intermediates) maps that memory again on
/// every call, which costs milliseconds of host time. Idempotent.
pub fn retain_pool_memory(ctx: &cudarc::driver::CudaContext) -> Result<()> {
    use cudarc::driver::sys;
    ctx.bind_to_thread()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold: u64 = u64::MAX;
    // SAFETY: `pool` and `threshold` are valid out/in pointers for the duration of the calls;
    // `cu_device()` is this context's device; the attribute takes a `u64`.
    unsafe {
        sys::cuDeviceGetMemPool(&mut pool, ctx.cu_device()).result()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .result()?;
    }
    Ok(())
}

/// The device memory `ctx`'s device has free once the memory pool has given back what it
/// holds unused (`cuMemPoolTrimTo(pool, 0)` after a synchronisation: freed stream-ordered
/// allocations otherwise stay reserved, see [`retain_pool_memory`]), in bytes: what a
/// measurement of the memory a model holds needs. Synchronises the context.
pub fn free_memory_trimmed(ctx: &cudarc::driver::CudaContext) -> Result<u64> {
    use cudarc::driver::sys;
    ctx.bind_to_thread()?;
    ctx.synchronize()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out pointer for the call; `cu_device()` is this context's
    // device; trimming a pool only returns unused reserved memory.
    unsafe {
        sys::cuDeviceGetMemPool(&mut pool, ctx.cu_device()).result()?;
        sys::cuMemPoolTrimTo(pool, 0).result()?;
    }
    let (free, _) = ctx.mem_get_info()?;
    Ok(free as u64)
}

/// A stream for communication work (transfers and their waits) on `ctx`, at the device's
/// greatest priority, as DeepEP's communication stream: while compute kernels beside it hold the
/// SMs, the block scheduler starts this stream's pending blocks first as SMs free up, so a
/// transfer issued after a GEMM does not wait for the GEMM's later waves.
pub fn new_comm_stream(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
) -> Result<std::sync::Arc<cudarc::driver::CudaStream>> {
    ctx.bind_to_thread()?;
    let (_, greatest) = cudarc::driver::result::stream::get_priority_range()?;
    Ok(ctx.new_stream_with_priority(greatest)?)
}
