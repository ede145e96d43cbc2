//! Launchers of the grouped GEMMs: CUTLASS kernels of the host library (see
//! `grouped_gemm_sm90.cuh`, plain or with the SwiGLU epilogue) and the tile-less GEMV
//! (`grouped_gemv.cu`). Host twins: [`super::host`].
//!
//! One module per kernel source: the C entry points of each CUTLASS configuration
//! (`grouped_bf16_{wide,wide_m,narrow}.cu`, `swiglu_bf16_{wide,wide_m,narrow}.cu`) in the
//! module of the same name, launched by the grouped GEMMs here (which share the workspace, the
//! checks and the arguments); `grouped_gemv` (`grouped_gemv.cu`); `swiglu_rows`
//! (`swiglu_rows.cu`, SwiGLU over dense rows).

mod grouped_gemv;
mod swiglu_rows;

pub use swiglu_rows::swiglu_rows_bf16_cuda;

use std::ffi::{c_char, CStr};
use std::sync::Arc;

use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::{GemmGrid, GemmTiles, GroupLayout, GroupedGemmShape, MAX_GROUPS};
use crate::cuda::{check_align, Kernels};
use crate::error::{Error, Result};
use grouped_gemv::{launch_gemv, GemvParams};

/// Mirror of `ep::gemm::GroupedGemmArgs` in `grouped_gemm_sm90.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GroupedGemmArgs {
    a: CUdeviceptr,
    b: CUdeviceptr,
    d: CUdeviceptr,
    counts: CUdeviceptr,
    workspace: CUdeviceptr,
    workspace_bytes: u64,
    rows: i64,
    groups: i32,
    n: i32,
    k: i32,
    layout: i32,
    m_max: i32,
    alignment: i32,
    sm_count: i32,
    first_extra: i32,
    extra_a: CUdeviceptr,
    extra_b: CUdeviceptr,
    extra_a_rows: i64,
}
const _: () = assert!(std::mem::size_of::<GroupedGemmArgs>() == 112);
const _: () = assert!(std::mem::offset_of!(GroupedGemmArgs, extra_a) == 88);
const _: () = assert!(std::mem::offset_of!(GroupedGemmArgs, extra_a_rows) == 104);
const _: () = assert!(std::mem::offset_of!(GroupedGemmArgs, rows) == 48);
const _: () = assert!(std::mem::offset_of!(GroupedGemmArgs, layout) == 68);
const _: () = assert!(std::mem::offset_of!(GroupedGemmArgs, sm_count) == 80);

type RunFn = unsafe extern "C" fn(*const GroupedGemmArgs, CUstream, *mut c_char, u64) -> i32;
type WorkspaceFn = unsafe extern "C" fn(i32, i32) -> u64;

/// Declares the two C entry points of a CUTLASS configuration (`EP_GROUPED_GEMM_BF16` in
/// `grouped_gemm_sm90.cuh`): its workspace size and its run function. Used by the module of
/// each configuration's source.
macro_rules! cutlass_entry_points {
    ($($workspace:ident, $run:ident;)*) => {
        extern "C" {
            $(
                pub(super) fn $workspace(groups: i32, sm_count: i32) -> u64;
                pub(super) fn $run(
                    args: *const super::GroupedGemmArgs,
                    stream: cudarc::driver::sys::CUstream,
                    message: *mut std::ffi::c_char,
                    message_len: u64,
                ) -> i32;
            )*
        }
    };
}

mod grouped_bf16_narrow;
mod grouped_bf16_wide;
mod grouped_bf16_wide_m;
mod swiglu_bf16_narrow;
mod swiglu_bf16_wide;
mod swiglu_bf16_wide_m;

/// What a grouped GEMM writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Epilogue {
    /// `d = a x b^T`, `[rows, n]`.
    Plain,
    /// `act = silu(gate) * up`, `[rows, n / 2]`, `b` the blocked gate_up weight.
    Swiglu,
}

impl GemmTiles {
    /// [`GemmTiles::for_masked_rows`] for the GPU of `stream` (its peak DRAM bandwidth per SM).
    pub fn for_masked_rows_cuda(stream: &CudaStream, expected_rows: usize) -> Result<GemmTiles> {
        let kernels = Kernels::for_stream(stream)?;
        let props = kernels.props();
        let per_sm = f64::from(props.peak_memory_gbs) / f64::from(props.sm_count.max(1));
        Ok(GemmTiles::for_masked_rows(expected_rows, per_sm))
    }
}

/// The entry points of a resolved tile configuration (a CUTLASS one: not `Gemv`).
fn entry_points(tiles: GemmTiles, epilogue: Epilogue) -> (&'static str, WorkspaceFn, RunFn) {
    match (tiles, epilogue) {
        (GemmTiles::Narrow, Epilogue::Plain) => (
            "grouped_gemm_bf16_narrow",
            grouped_bf16_narrow::ep_grouped_gemm_bf16_narrow_workspace,
            grouped_bf16_narrow::ep_grouped_gemm_bf16_narrow_run,
        ),
        (GemmTiles::WideM, Epilogue::Plain) => (
            "grouped_gemm_bf16_wide_m",
            grouped_bf16_wide_m::ep_grouped_gemm_bf16_wide_m_workspace,
            grouped_bf16_wide_m::ep_grouped_gemm_bf16_wide_m_run,
        ),
        (GemmTiles::Wide | GemmTiles::Auto | GemmTiles::Gemv, Epilogue::Plain) => (
            "grouped_gemm_bf16_wide",
            grouped_bf16_wide::ep_grouped_gemm_bf16_wide_workspace,
            grouped_bf16_wide::ep_grouped_gemm_bf16_wide_run,
        ),
        (GemmTiles::Narrow, Epilogue::Swiglu) => (
            "grouped_gemm_bf16_swiglu_narrow",
            swiglu_bf16_narrow::ep_grouped_gemm_bf16_swiglu_narrow_workspace,
            swiglu_bf16_narrow::ep_grouped_gemm_bf16_swiglu_narrow_run,
        ),
        (GemmTiles::WideM, Epilogue::Swiglu) => (
            "grouped_gemm_bf16_swiglu_wide_m",
            swiglu_bf16_wide_m::ep_grouped_gemm_bf16_swiglu_wide_m_workspace,
            swiglu_bf16_wide_m::ep_grouped_gemm_bf16_swiglu_wide_m_run,
        ),
        (GemmTiles::Wide | GemmTiles::Auto | GemmTiles::Gemv, Epilogue::Swiglu) => (
            "grouped_gemm_bf16_swiglu_wide",
            swiglu_bf16_wide::ep_grouped_gemm_bf16_swiglu_wide_workspace,
            swiglu_bf16_wide::ep_grouped_gemm_bf16_swiglu_wide_run,
        ),
    }
}

/// Most CTAs a [`GemmGrid::PerTile`] launch sizes its workspace for (about 8 MB of TMA
/// descriptors); a GEMM with more tiles loops its CTAs over them.
pub const MAX_PER_TILE_CTAS: u32 = 16384;

/// Device memory a grouped GEMM needs besides its operands: the per-group tables the setup
/// kernel writes (shapes, pointers, strides) and CUTLASS's own workspace (TMA descriptors per
/// CTA), and the grid its GEMMs launch ([`GemmGrid`]). One workspace serves any number of GEMMs
/// issued one after another on one stream; GEMMs that may run at the same time (other streams)
/// need one each.
#[derive(Debug)]
pub struct GroupedGemmWorkspace {
    pub(super) buf: CudaSlice<u8>,
    pub(super) max_groups: usize,
    /// SMs of a [`GemmGrid::Persistent`] launch.
    sm_count: u32,
    /// The device's SMs.
    device_sms: u32,
    /// CTAs whose descriptors `buf` has room for.
    max_ctas: u32,
    grid: GemmGrid,
    /// The fused SwiGLU GEMV's arrival counters, [`crate::gemm::fp8::GEMV_SWIGLU_MAX_ACT_BLOCKS`]
    /// a group, zero between launches (`grouped_gemv_fp8.cu`).
    pub(crate) arrivals: CudaSlice<u32>,
}

impl GroupedGemmWorkspace {
    /// A workspace for GEMMs of up to `max_groups` groups on `stream`'s device, using every SM.
    pub fn new(stream: &Arc<CudaStream>, max_groups: usize) -> Result<Self> {
        let sms = Kernels::for_stream(stream)?.props().sm_count;
        Self::with_sm_count(stream, max_groups, sms)
    }

    /// Like [`GroupedGemmWorkspace::new`], for GEMMs that occupy at most `sm_count` SMs (the
    /// persistent kernels' grid; fewer leave SMs to kernels on other streams, e.g.
    /// communication).
    pub fn with_sm_count(
        stream: &Arc<CudaStream>,
        max_groups: usize,
        sm_count: u32,
    ) -> Result<Self> {
        let props = *Kernels::for_stream(stream)?.props();
        if max_groups == 0 || max_groups > MAX_GROUPS {
            return Err(Error::invalid(
                "max_groups",
                max_groups,
                format!("must be in 1..={MAX_GROUPS}"),
            ));
        }
        if sm_count == 0 || sm_count > props.sm_count {
            return Err(Error::invalid(
                "sm_count",
                sm_count,
                format!("must be in 1..={} (the device's SMs)", props.sm_count),
            ));
        }
        // The experts' intermediates are allocated stream-ordered on every forward.
        crate::cuda::retain_pool_memory(stream.context())?;
        let buf = stream.alloc_zeros::<u8>(Self::bytes(max_groups, sm_count) as usize)?;
        let arrivals =
            stream.alloc_zeros::<u32>(max_groups * crate::gemm::fp8::GEMV_SWIGLU_MAX_ACT_BLOCKS)?;
        Ok(Self {
            buf,
            max_groups,
            sm_count,
            device_sms: props.sm_count,
            max_ctas: sm_count,
            grid: GemmGrid::Persistent,
            arrivals,
        })
    }

    /// Bytes every CUTLASS configuration (bf16 and fp8) needs for `max_groups` groups on
    /// `ctas` CTAs.
    fn bytes(max_groups: usize, ctas: u32) -> u64 {
        let tiles = [GemmTiles::Wide, GemmTiles::WideM, GemmTiles::Narrow];
        let bf16 = tiles
            .into_iter()
            .flat_map(|t| [(t, Epilogue::Plain), (t, Epilogue::Swiglu)])
            .map(|(t, e)| {
                let (_, workspace, _) = entry_points(t, e);
                // SAFETY: pure host computation on two integers (no device access).
                unsafe { workspace(max_groups as i32, ctas as i32) }
            })
            .max()
            .unwrap_or(0);
        bf16.max(super::fp8::workspace_bytes(max_groups, ctas))
    }

    /// Sets the grid of the GEMMs launched with this workspace from now on.
    /// [`GemmGrid::PersistentOn`] takes 1 to the device's SMs.
    pub fn set_grid(&mut self, grid: GemmGrid) -> Result<()> {
        if let GemmGrid::PersistentOn(n) = grid {
            if n == 0 || n > self.device_sms {
                return Err(Error::invalid(
                    "grid",
                    format!("{grid:?}"),
                    format!("must be on 1..={} SMs (the device's)", self.device_sms),
                ));
            }
        }
        self.grid = grid;
        Ok(())
    }

    /// The grid of the GEMMs launched with this workspace.
    pub fn grid(&self) -> GemmGrid {
        self.grid
    }

    /// Most groups a GEMM using this workspace may have.
    pub fn max_groups(&self) -> usize {
        self.max_groups
    }

    /// SMs a persistent GEMM occupies.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// The CTAs a CUTLASS GEMM of `shape` with `tiles` launches under the current grid, after
    /// making room for their descriptors (a larger buffer, allocated on `stream`).
    fn ctas_for(
        &mut self,
        stream: &Arc<CudaStream>,
        tiles: GemmTiles,
        shape: &GroupedGemmShape,
    ) -> Result<u32> {
        let cluster = tiles
            .tile_and_cluster()
            .map_or(1, |(_, (cm, cn))| (cm * cn) as u32);
        self.ctas_for_tiles(stream, cluster, tiles.max_tiles(shape))
    }

    /// [`GroupedGemmWorkspace::ctas_for`] of a configuration with clusters of `cluster` CTAs
    /// and at most `max_tiles` output tiles (`None`: unknown).
    pub(super) fn ctas_for_tiles(
        &mut self,
        stream: &Arc<CudaStream>,
        cluster: u32,
        max_tiles: Option<usize>,
    ) -> Result<u32> {
        // Whole clusters: CUTLASS fails a launch whose grid is not a multiple of them (an odd
        // count with clusters along M).
        let persistent = |sms: u32| (sms / cluster).max(1) * cluster;
        let ctas = match self.grid {
            GemmGrid::Persistent => persistent(self.sm_count),
            GemmGrid::PersistentOn(n) => persistent(n),
            GemmGrid::PerTile => max_tiles.map_or(persistent(self.sm_count), |t| {
                (t.clamp(1, MAX_PER_TILE_CTAS as usize) as u32).next_multiple_of(cluster)
            }),
        };
        if ctas > self.max_ctas {
            self.buf = stream.alloc_zeros::<u8>(Self::bytes(self.max_groups, ctas) as usize)?;
            self.max_ctas = ctas;
        }
        Ok(ctas)
    }
}

/// The last groups of a masked grouped GEMM when they are not routed experts (e.g. a MoE
/// layer's shared experts, split into blocks of the routed experts' width): groups `first..`
/// take their weights from `b` (`[groups - first, n, k]`) and, when `a` is given, their input
/// rows from `a` (`[rows, k]`, the same rows for every extra group: the layer's tokens) instead
/// of their blocks of the GEMM's `a`. Their outputs land in their blocks of `d`, their row
/// counts come from `counts` like the others'.
pub struct ExtraGroups<'a> {
    /// Index of the first extra group.
    pub first: usize,
    /// Weights of the extra groups, `[groups - first, n, k]`.
    pub b: &'a dyn DevicePtr<bf16>,
    /// Input rows of every extra group, `[rows, k]`; `None`: their blocks of `a`.
    pub a: Option<&'a dyn DevicePtr<bf16>>,
}

impl std::fmt::Debug for ExtraGroups<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExtraGroups")
            .field("first", &self.first)
            .field("b_len", &self.b.len())
            .field("a_len", &self.a.map(|a| a.len()))
            .finish()
    }
}

/// Checks that `workspace` can serve a GEMM of `groups` groups on `stream`'s device.
pub(super) fn check_workspace(
    workspace: &GroupedGemmWorkspace,
    stream: &Arc<CudaStream>,
    groups: usize,
) -> Result<()> {
    if groups > workspace.max_groups {
        return Err(Error::invalid(
            "workspace",
            format!("sized for {} groups", workspace.max_groups),
            format!("this GEMM has {groups} groups"),
        ));
    }
    if workspace.buf.context().cu_ctx() != stream.context().cu_ctx() {
        return Err(Error::invalid(
            "workspace",
            format!("memory of device {}", workspace.buf.context().ordinal()),
            format!(
                "must be on the stream's device {}",
                stream.context().ordinal()
            ),
        ));
    }
    Ok(())
}

/// Grouped GEMM on `stream`: for every group `g` and valid row `r` of `shape.layout`,
/// `d[r, :] = a[r, :] x b[g]^T` (bf16 in and out, f32 accumulation). `a` is `[rows, k]`,
/// `b` `[groups, n, k]`, `d` `[rows, n]`, `counts` `[groups]` i32 on the device: read by the
/// kernels only, never by the host. Same result as the host twin [`super::grouped_gemm`] up to
/// the summation order.
///
/// Checked before launch: sizes and lengths, 16-byte aligned operands, the workspace's device
/// and group capacity. Checked on the device: the counts against the layout (a negative count,
/// one above `m_max`, or contiguous groups running past `a` print the offending entry and
/// trap, which fails the stream).
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_bf16_cuda(
    stream: &Arc<CudaStream>,
    a: &impl DevicePtr<bf16>,
    b: &impl DevicePtr<bf16>,
    counts: &impl DevicePtr<i32>,
    shape: &GroupedGemmShape,
    tiles: GemmTiles,
    d: &mut impl DevicePtrMut<bf16>,
    workspace: &mut GroupedGemmWorkspace,
) -> Result<()> {
    grouped_gemm_bf16_extra_cuda(stream, a, b, counts, shape, None, tiles, d, workspace)
}

/// [`grouped_gemm_bf16_cuda`] whose last groups are [`ExtraGroups`] (masked layout only):
/// `shape.groups` counts them, `b` holds the first `extra.first` groups' weights, and with
/// `extra.a` given `a` holds only the first `extra.first` blocks. Host twin:
/// [`super::host::grouped_gemm_extra`]. Also checked on the device: an extra group's count
/// above the rows of `extra.a`.
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_bf16_extra_cuda(
    stream: &Arc<CudaStream>,
    a: &impl DevicePtr<bf16>,
    b: &impl DevicePtr<bf16>,
    counts: &impl DevicePtr<i32>,
    shape: &GroupedGemmShape,
    extra: Option<&ExtraGroups<'_>>,
    tiles: GemmTiles,
    d: &mut impl DevicePtrMut<bf16>,
    workspace: &mut GroupedGemmWorkspace,
) -> Result<()> {
    run_grouped(
        stream,
        a,
        b,
        counts,
        shape,
        extra,
        tiles,
        d,
        workspace,
        Epilogue::Plain,
    )
}

/// The experts' first GEMM with SwiGLU in its epilogue: [`grouped_gemm_bf16_extra_cuda`] whose
/// `b` is each expert's gate_up weight in the blocked layout ([`super::GATE_UP_BLOCK`]:
/// `shape.n = 2I` rows per group) and whose output `act` (`[rows, I]`) receives, for every
/// valid row, `bf16(silu(gate) * up)` from the f32 products: the `[rows, 2I]` product is never
/// stored. Any [`GemmTiles`] (`Gemv` for masked blocks of a few rows); the workspace is only
/// read by the CUTLASS configurations. Host twin: [`super::host::grouped_gemm_swiglu`]. Same
/// checks as [`grouped_gemm_bf16_extra_cuda`], and `shape.n` a multiple of 16.
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_swiglu_bf16_cuda(
    stream: &Arc<CudaStream>,
    a: &impl DevicePtr<bf16>,
    b: &impl DevicePtr<bf16>,
    counts: &impl DevicePtr<i32>,
    shape: &GroupedGemmShape,
    extra: Option<&ExtraGroups<'_>>,
    tiles: GemmTiles,
    act: &mut impl DevicePtrMut<bf16>,
    workspace: &mut GroupedGemmWorkspace,
) -> Result<()> {
    if shape.n % (2 * super::GATE_UP_BLOCK) != 0 {
        return Err(Error::invalid(
            "n",
            shape.n,
            format!(
                "the gate_up width 2I must be a multiple of {} (I a multiple of {})",
                2 * super::GATE_UP_BLOCK,
                super::GATE_UP_BLOCK
            ),
        ));
    }
    run_grouped(
        stream,
        a,
        b,
        counts,
        shape,
        extra,
        tiles,
        act,
        workspace,
        Epilogue::Swiglu,
    )
}

/// The checks and launch behind the public GEMMs (output `[rows, n]`, or `[rows, n / 2]` with
/// the SwiGLU epilogue).
#[allow(clippy::too_many_arguments)]
fn run_grouped(
    stream: &Arc<CudaStream>,
    a: &impl DevicePtr<bf16>,
    b: &impl DevicePtr<bf16>,
    counts: &impl DevicePtr<i32>,
    shape: &GroupedGemmShape,
    extra: Option<&ExtraGroups<'_>>,
    tiles: GemmTiles,
    d: &mut impl DevicePtrMut<bf16>,
    workspace: &mut GroupedGemmWorkspace,
    epilogue: Epilogue,
) -> Result<()> {
    let swiglu = epilogue == Epilogue::Swiglu;
    shape.check()?;
    let GroupedGemmShape {
        groups,
        rows,
        n,
        k,
        layout,
    } = *shape;
    if tiles == GemmTiles::Gemv && !matches!(layout, GroupLayout::Masked { .. }) {
        return Err(Error::invalid(
            "tiles",
            "GemmTiles::Gemv",
            "takes the masked layout only",
        ));
    }
    let first_extra = match extra {
        None => groups,
        Some(x) => {
            let GroupLayout::Masked { m_max } = layout else {
                return Err(Error::invalid(
                    "extra",
                    "extra groups",
                    "need the masked layout",
                ));
            };
            if x.first == 0 || x.first >= groups {
                return Err(Error::invalid(
                    "extra.first",
                    x.first,
                    format!("must be in 1..{groups} (the GEMM's groups)"),
                ));
            }
            Error::check_len("extra.b", (groups - x.first) * n * k, x.b.len())?;
            if let Some(xa) = x.a {
                if xa.len() % k != 0 || xa.len() / k > m_max {
                    return Err(Error::invalid(
                        "extra.a",
                        format!("{} elements", xa.len()),
                        format!("must be [rows <= m_max = {m_max}, k = {k}]"),
                    ));
                }
            }
            x.first
        }
    };
    // With their own input rows the extra groups' blocks of `a` are not read.
    let a_rows = match extra.and_then(|x| x.a) {
        Some(_) => rows / groups * first_extra,
        None => rows,
    };
    Error::check_len("a", a_rows * k, a.len())?;
    Error::check_len("b", first_extra * n * k, b.len())?;
    Error::check_len("counts", groups, counts.len())?;
    if swiglu {
        Error::check_len("act", rows * (n / 2), d.len())?;
    } else {
        Error::check_len("d", rows * n, d.len())?;
    }
    check_workspace(workspace, stream, groups)?;
    if rows == 0 {
        return Ok(());
    }
    let tiles = tiles.resolve(layout, rows, groups);
    let (m_max, alignment) = layout.params();
    stream.context().bind_to_thread()?;
    let (a_ptr, _ga) = a.device_ptr(stream);
    let (b_ptr, _gb) = b.device_ptr(stream);
    let (c_ptr, _gc) = counts.device_ptr(stream);
    let (d_ptr, _gd) = d.device_ptr_mut(stream);
    let (xb_ptr, _gxb) = match extra {
        Some(x) => {
            let (p, g) = x.b.device_ptr(stream);
            (p, Some(g))
        }
        None => (0, None),
    };
    let (xa_ptr, xa_rows, _gxa) = match extra.and_then(|x| x.a) {
        Some(xa) => {
            let (p, g) = xa.device_ptr(stream);
            (p, (xa.len() / k) as i64, Some(g))
        }
        None => (0, 0, None),
    };
    for (arg, ptr) in [("a", a_ptr), ("b", b_ptr), ("d", d_ptr)] {
        check_align(arg, ptr, 16)?;
    }
    for (arg, ptr) in [("extra.b", xb_ptr), ("extra.a", xa_ptr)] {
        if ptr != 0 {
            check_align(arg, ptr, 16)?;
        }
    }
    if tiles == GemmTiles::Gemv {
        let params = GemvParams {
            a: a_ptr,
            b: b_ptr,
            d: d_ptr,
            counts: c_ptr,
            extra_a: xa_ptr,
            extra_b: xb_ptr,
            extra_a_rows: xa_rows,
            // The casts fit: `shape.check` bounds groups by MAX_GROUPS and n, k by i32::MAX.
            groups: groups as i32,
            n: n as i32,
            k: k as i32,
            m_max,
            first_extra: first_extra as i32,
            reserved: 0,
        };
        return launch_gemv(stream, params, groups, n, swiglu);
    }
    let (kernel, _, run) = entry_points(tiles, epilogue);
    let ctas = workspace.ctas_for(stream, tiles, shape)?;
    let ws_bytes = workspace.buf.len() as u64;
    let (ws_ptr, _gw) = workspace.buf.device_ptr_mut(stream);
    let args = GroupedGemmArgs {
        a: a_ptr,
        b: b_ptr,
        d: d_ptr,
        counts: c_ptr,
        workspace: ws_ptr,
        workspace_bytes: ws_bytes,
        rows: rows as i64,
        // The casts fit: `shape.check` bounds groups by MAX_GROUPS and n, k by i32::MAX.
        groups: groups as i32,
        n: n as i32,
        k: k as i32,
        layout: layout.code(),
        m_max,
        alignment,
        // At most MAX_PER_TILE_CTAS or the device's SMs: fits an i32.
        sm_count: ctas as i32,
        first_extra: first_extra as i32,
        extra_a: xa_ptr,
        extra_b: xb_ptr,
        extra_a_rows: xa_rows,
    };
    let mut message = [0 as c_char; 256];
    // SAFETY: `args` mirrors `GroupedGemmArgs` (size and offsets asserted); `a`, `b`, `d`,
    // `counts` and the extra groups' operands hold the elements the shape implies (checked
    // above) and stay borrowed, with cudarc's guards keeping stream order, until the launches
    // are queued; the kernels only touch rows the device counts make valid, which the setup
    // kernel checks against `rows` and the rows of `extra.a`; the workspace is this context's
    // and holds `ws_bytes`, which the entry point checks against what the configuration needs;
    // `stream` is a live stream of the bound context; `message` outlives the call, which
    // writes at most `message.len()` bytes.
    let code = unsafe {
        run(
            &args,
            stream.cu_stream(),
            message.as_mut_ptr(),
            message.len() as u64,
        )
    };
    if code != 0 {
        // SAFETY: the entry point wrote a NUL-terminated string (snprintf) into `message`,
        // which was zeroed and is never fully overwritten by a terminator-less string.
        let text = unsafe { CStr::from_ptr(message.as_ptr()) };
        return Err(Error::Launch {
            kernel,
            message: format!("{} (code {code})", text.to_string_lossy()),
        });
    }
    Ok(())
}
