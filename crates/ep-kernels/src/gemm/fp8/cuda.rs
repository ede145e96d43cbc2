//! Launchers of the block-scaled fp8 grouped GEMMs (CUTLASS kernels of the host library,
//! `fp8/grouped_gemm_fp8_sm90.cuh`), of the experts' row quantizations (their input rows, and
//! SwiGLU with its quantization: `quantize_rows.cu`) and of the weight dequantization
//! (`dequantize.cu`). Host twins: [`super::host`].

use std::ffi::{c_char, CStr};
use std::sync::Arc;

use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use float8::F8E4M3;
use half::bf16;

use super::{check_shape, row_scale_cols, weight_scale_dims, FP8_BLOCK, GEMV_K_MULTIPLE};
use crate::cuda::check_align;
use crate::error::{Error, Result};
use crate::gemm::cuda::check_workspace;
use crate::gemm::{GemmTiles, GroupLayout, GroupedGemmShape, GroupedGemmWorkspace};

/// Mirror of `ep::gemm::GroupedGemmFp8Args` in `fp8/grouped_gemm_fp8_sm90.cuh`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GroupedGemmFp8Args {
    a: CUdeviceptr,
    sfa: CUdeviceptr,
    b: CUdeviceptr,
    sfb: CUdeviceptr,
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
    extra_sfa: CUdeviceptr,
    extra_b: CUdeviceptr,
    extra_sfb: CUdeviceptr,
    extra_a_rows: i64,
}
const _: () = assert!(std::mem::size_of::<GroupedGemmFp8Args>() == 144);
const _: () = assert!(std::mem::offset_of!(GroupedGemmFp8Args, rows) == 64);
const _: () = assert!(std::mem::offset_of!(GroupedGemmFp8Args, first_extra) == 100);
const _: () = assert!(std::mem::offset_of!(GroupedGemmFp8Args, extra_a) == 104);
const _: () = assert!(std::mem::offset_of!(GroupedGemmFp8Args, extra_a_rows) == 136);

type RunFn = unsafe extern "C" fn(*const GroupedGemmFp8Args, CUstream, *mut c_char, u64) -> i32;
type WorkspaceFn = unsafe extern "C" fn(i32, i32) -> u64;

extern "C" {
    fn ep_grouped_gemm_fp8_wide_workspace(groups: i32, sm_count: i32) -> u64;
    fn ep_grouped_gemm_fp8_wide_run(
        args: *const GroupedGemmFp8Args,
        stream: CUstream,
        message: *mut c_char,
        message_len: u64,
    ) -> i32;
    fn ep_grouped_gemm_fp8_narrow_workspace(groups: i32, sm_count: i32) -> u64;
    fn ep_grouped_gemm_fp8_narrow_run(
        args: *const GroupedGemmFp8Args,
        stream: CUstream,
        message: *mut c_char,
        message_len: u64,
    ) -> i32;
}

/// The fp8 tile configurations: `(tile, cluster)` of [`Fp8Tiles::Wide`] and
/// [`Fp8Tiles::Narrow`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fp8Tiles {
    /// 128 x 128 cooperative tiles, clusters of 2 along N.
    Wide,
    /// 64 x 128 ping-pong tiles, clusters of 2 along N.
    Narrow,
}

impl Fp8Tiles {
    /// The configuration `tiles` asks for (`Auto` resolved as for bf16: narrow tiles for the
    /// masked layout, wide ones for the contiguous layout).
    fn from(tiles: GemmTiles, layout: GroupLayout, rows: usize, groups: usize) -> Result<Self> {
        match tiles.resolve(layout, rows, groups) {
            GemmTiles::Narrow => Ok(Fp8Tiles::Narrow),
            GemmTiles::Wide | GemmTiles::WideM => Ok(Fp8Tiles::Wide),
            GemmTiles::Gemv => unreachable!("the caller launches the GEMV itself"),
            GemmTiles::Auto => unreachable!("resolve() resolves Auto"),
        }
    }

    fn shape(self) -> ((usize, usize), (usize, usize)) {
        match self {
            Fp8Tiles::Wide => ((128, 128), (1, 2)),
            Fp8Tiles::Narrow => ((64, 128), (1, 2)),
        }
    }

    /// An upper bound of the output tiles of `shape` (every group may end in a partial M tile).
    fn max_tiles(self, shape: &GroupedGemmShape) -> usize {
        let ((tm, tn), (cm, cn)) = self.shape();
        let m_tiles = shape.rows.div_ceil(tm) + shape.groups * cm;
        m_tiles * shape.n.div_ceil(tn).next_multiple_of(cn)
    }

    fn entry_points(self) -> (&'static str, WorkspaceFn, RunFn) {
        match self {
            Fp8Tiles::Wide => (
                "grouped_gemm_fp8_wide",
                ep_grouped_gemm_fp8_wide_workspace,
                ep_grouped_gemm_fp8_wide_run,
            ),
            Fp8Tiles::Narrow => (
                "grouped_gemm_fp8_narrow",
                ep_grouped_gemm_fp8_narrow_workspace,
                ep_grouped_gemm_fp8_narrow_run,
            ),
        }
    }
}

/// The device address of an optional operand (0 without one), its guard kept in `guards`.
fn opt_ptr<'a, T>(
    p: Option<&'a dyn DevicePtr<T>>,
    stream: &'a CudaStream,
    guards: &mut Vec<SyncOnDrop<'a>>,
) -> CUdeviceptr {
    p.map_or(0, |p| {
        let (ptr, guard) = p.device_ptr(stream);
        guards.push(guard);
        ptr
    })
}

/// Bytes every fp8 configuration needs for `max_groups` groups on `ctas` CTAs (part of
/// [`GroupedGemmWorkspace`]'s size).
pub(crate) fn workspace_bytes(max_groups: usize, ctas: u32) -> u64 {
    [Fp8Tiles::Wide, Fp8Tiles::Narrow]
        .into_iter()
        .map(|t| t.entry_points().1)
        // SAFETY: pure host computation on two integers (no device access).
        .map(|workspace| unsafe { workspace(max_groups as i32, ctas as i32) })
        .max()
        .unwrap_or(0)
}

/// A block-scaled e4m3 operand on the device: its values and its f32 scales (layouts in
/// [`super`]).
pub struct DeviceFp8<'a> {
    /// The e4m3 values.
    pub q: &'a dyn DevicePtr<F8E4M3>,
    /// The scales.
    pub scales: &'a dyn DevicePtr<f32>,
}

impl std::fmt::Debug for DeviceFp8<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceFp8")
            .field("q_len", &self.q.len())
            .field("scales_len", &self.scales.len())
            .finish()
    }
}

/// The last groups of a masked fp8 GEMM when they are not routed experts (the shared experts):
/// as `gemm::ExtraGroups`, with scales. `first` may be 0: every group is then an extra one (the
/// shared experts alone) and the GEMM's own `b` is not read, nor its `a` with `extra.a`.
#[derive(Debug)]
pub struct ExtraGroupsFp8<'a> {
    /// Index of the first extra group.
    pub first: usize,
    /// Weights of the extra groups, `[groups - first, n, k]`, with their scales.
    pub b: DeviceFp8<'a>,
    /// Input rows of every extra group, `[rows, k]` with their scales; `None`: their blocks of
    /// `a`.
    pub a: Option<DeviceFp8<'a>>,
}

/// Block-scaled fp8 grouped GEMM on `stream`: for every group `g` and valid row `r` of
/// `shape.layout`, `d[r, :] = bf16(deq(a)[r, :] x deq(b[g])^T)` (f32 accumulation promoted
/// through the scales every 128 channels). `a` `[rows, k]` with `[rows, ceil(k / 128)]` scales,
/// `b` `[groups, n, k]` with `[groups, ceil(n / 128), ceil(k / 128)]` scales, `d` `[rows, n]`,
/// `counts` `[groups]` i32 read by the kernels only. Host twin: [`super::grouped_gemm_fp8`].
///
/// `tiles`: a CUTLASS configuration, or [`GemmTiles::Gemv`] for masked blocks of a few rows
/// (the tile-less `grouped_gemv_fp8.cu`, `k` a multiple of [`super::GEMV_K_MULTIPLE`];
/// [`super::masked_tiles`] picks it).
///
/// Checked before launch: sizes and lengths, 16-byte aligned operands, the workspace. Checked
/// on the device: the counts against the layout (as the bf16 GEMMs).
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_fp8_cuda(
    stream: &Arc<CudaStream>,
    a: &DeviceFp8<'_>,
    b: &DeviceFp8<'_>,
    counts: &impl DevicePtr<i32>,
    shape: &GroupedGemmShape,
    extra: Option<&ExtraGroupsFp8<'_>>,
    tiles: GemmTiles,
    d: &mut impl DevicePtrMut<bf16>,
    workspace: &mut GroupedGemmWorkspace,
) -> Result<()> {
    run(stream, a, b, counts, shape, extra, tiles, d, workspace)
}

#[allow(clippy::too_many_arguments)]
fn run(
    stream: &Arc<CudaStream>,
    a: &DeviceFp8<'_>,
    b: &DeviceFp8<'_>,
    counts: &impl DevicePtr<i32>,
    shape: &GroupedGemmShape,
    extra: Option<&ExtraGroupsFp8<'_>>,
    tiles: GemmTiles,
    d: &mut impl DevicePtrMut<bf16>,
    workspace: &mut GroupedGemmWorkspace,
) -> Result<()> {
    check_shape(shape)?;
    let GroupedGemmShape {
        groups,
        rows,
        n,
        k,
        layout,
    } = *shape;
    let ks = row_scale_cols(k);
    let (sr, sc) = weight_scale_dims(n, k, FP8_BLOCK);
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
            if x.first >= groups {
                return Err(Error::invalid(
                    "extra.first",
                    x.first,
                    format!("must be below the GEMM's {groups} groups"),
                ));
            }
            Error::check_len("extra.b", (groups - x.first) * n * k, x.b.q.len())?;
            Error::check_len(
                "extra.b scales",
                (groups - x.first) * sr * sc,
                x.b.scales.len(),
            )?;
            if let Some(xa) = &x.a {
                let xr = xa.q.len() / k;
                if xa.q.len() % k != 0 || xr > m_max {
                    return Err(Error::invalid(
                        "extra.a",
                        format!("{} elements", xa.q.len()),
                        format!("must be [rows <= m_max = {m_max}, k = {k}]"),
                    ));
                }
                Error::check_len("extra.a scales", xr * ks, xa.scales.len())?;
            }
            x.first
        }
    };
    let a_rows = match extra.and_then(|x| x.a.as_ref()) {
        Some(_) => rows / groups * first_extra,
        None => rows,
    };
    Error::check_len("a", a_rows * k, a.q.len())?;
    Error::check_len("a scales", a_rows * ks, a.scales.len())?;
    Error::check_len("b", first_extra * n * k, b.q.len())?;
    Error::check_len("b scales", first_extra * sr * sc, b.scales.len())?;
    Error::check_len("counts", groups, counts.len())?;
    Error::check_len("d", rows * n, d.len())?;
    check_workspace(workspace, stream, groups)?;
    if rows == 0 {
        return Ok(());
    }
    let gemv = tiles.resolve(layout, rows, groups) == GemmTiles::Gemv;
    if gemv {
        check_gemv(layout, k)?;
    }
    let (m_max, alignment) = layout.params();
    stream.context().bind_to_thread()?;
    let (a_ptr, _ga) = a.q.device_ptr(stream);
    let (sfa_ptr, _gsa) = a.scales.device_ptr(stream);
    let (b_ptr, _gb) = b.q.device_ptr(stream);
    let (sfb_ptr, _gsb) = b.scales.device_ptr(stream);
    let (c_ptr, _gc) = counts.device_ptr(stream);
    let (d_ptr, _gd) = d.device_ptr_mut(stream);
    let mut guards = Vec::new();
    let xb_ptr = opt_ptr(extra.map(|x| x.b.q), stream, &mut guards);
    let xsb_ptr = opt_ptr(extra.map(|x| x.b.scales), stream, &mut guards);
    let extra_a = extra.and_then(|x| x.a.as_ref());
    let xa_ptr = opt_ptr(extra_a.map(|x| x.q), stream, &mut guards);
    let xsa_ptr = opt_ptr(extra_a.map(|x| x.scales), stream, &mut guards);
    let xa_rows = extra_a.map_or(0, |x| (x.q.len() / k) as i64);
    for (arg, p) in [("a", a_ptr), ("b", b_ptr), ("d", d_ptr)] {
        check_align(arg, p, 16)?;
    }
    for (arg, p) in [("extra.b", xb_ptr), ("extra.a", xa_ptr)] {
        if p != 0 {
            check_align(arg, p, 16)?;
        }
    }
    for (arg, p) in [
        ("a scales", sfa_ptr),
        ("b scales", sfb_ptr),
        ("extra.a scales", xsa_ptr),
        ("extra.b scales", xsb_ptr),
    ] {
        if p != 0 {
            check_align(arg, p, 4)?;
        }
    }
    if gemv {
        let params = GemvFp8Params {
            a: a_ptr,
            sfa: sfa_ptr,
            b: b_ptr,
            sfb: sfb_ptr,
            d: d_ptr,
            counts: c_ptr,
            extra_a: xa_ptr,
            extra_sfa: xsa_ptr,
            extra_b: xb_ptr,
            extra_sfb: xsb_ptr,
            extra_a_rows: xa_rows,
            // The casts fit: `shape.check` bounds groups by MAX_GROUPS and n, k by i32::MAX.
            groups: groups as i32,
            n: n as i32,
            k: k as i32,
            m_max,
            first_extra: first_extra as i32,
            // Set by `launch_gemv` from the grid.
            k_split: 1,
        };
        let launched = launch_gemv(stream, params);
        drop(guards);
        return launched;
    }
    let tiles = Fp8Tiles::from(tiles, layout, rows, groups)?;
    let (kernel, _, run) = tiles.entry_points();
    let ((_, _), (cm, cn)) = tiles.shape();
    let ctas = workspace.ctas_for_tiles(stream, (cm * cn) as u32, Some(tiles.max_tiles(shape)))?;
    let ws_bytes = workspace.buf.len() as u64;
    let (ws_ptr, _gw) = workspace.buf.device_ptr_mut(stream);
    let args = GroupedGemmFp8Args {
        a: a_ptr,
        sfa: sfa_ptr,
        b: b_ptr,
        sfb: sfb_ptr,
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
        extra_sfa: xsa_ptr,
        extra_b: xb_ptr,
        extra_sfb: xsb_ptr,
        extra_a_rows: xa_rows,
    };
    let mut message = [0 as c_char; 256];
    // SAFETY: `args` mirrors `GroupedGemmFp8Args` (size and offsets asserted); every operand
    // and scale tensor holds the elements the shape implies (checked above) and stays borrowed,
    // with cudarc's guards keeping stream order, until the launches are queued; the kernels
    // only touch rows the device counts make valid, which the setup kernel checks against
    // `rows` and the rows of `extra.a`; the workspace is this context's and holds `ws_bytes`,
    // which the entry point checks against what the configuration needs; `stream` is a live
    // stream of the bound context; `message` outlives the call, which writes at most
    // `message.len()` bytes.
    let code = unsafe {
        run(
            &args,
            stream.cu_stream(),
            message.as_mut_ptr(),
            message.len() as u64,
        )
    };
    drop(guards);
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

/// What the tile-less GEMV takes beyond the GEMMs' checks: the masked layout, `k` a multiple of
/// [`GEMV_K_MULTIPLE`] (`n` is a multiple of 16 for every fp8 GEMM).
fn check_gemv(layout: GroupLayout, k: usize) -> Result<()> {
    if !matches!(layout, GroupLayout::Masked { .. }) {
        return Err(Error::invalid(
            "tiles",
            "GemmTiles::Gemv",
            "the tile-less fp8 GEMV takes the masked layout only",
        ));
    }
    if k % GEMV_K_MULTIPLE != 0 {
        return Err(Error::invalid(
            "k",
            k,
            format!("the tile-less fp8 GEMV needs a multiple of {GEMV_K_MULTIPLE}"),
        ));
    }
    Ok(())
}

/// The cubin of `fp8/grouped_gemv_fp8.cu`.
const GEMV_FILE: &str = "gemm/fp8/grouped_gemv_fp8";
/// Threads per block (`kThreads`).
const GEMV_THREADS: u32 = 256;
/// Resident blocks per SM the grid is sized to (`kBlocksPerSm`; grid-stride over the units).
const GEMV_BLOCKS_PER_SM: u32 = 2;

/// Mirror of `struct GemvFp8Params` in `fp8/grouped_gemv_fp8.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GemvFp8Params {
    a: CUdeviceptr,
    sfa: CUdeviceptr,
    b: CUdeviceptr,
    sfb: CUdeviceptr,
    d: CUdeviceptr,
    counts: CUdeviceptr,
    extra_a: CUdeviceptr,
    extra_sfa: CUdeviceptr,
    extra_b: CUdeviceptr,
    extra_sfb: CUdeviceptr,
    extra_a_rows: i64,
    groups: i32,
    n: i32,
    k: i32,
    m_max: i32,
    first_extra: i32,
    k_split: i32,
}
crate::cuda::assert_params_layout!(
    GemvFp8Params,
    112;
    a = 0, sfa = 8, b = 16, sfb = 24, d = 32, counts = 40, extra_a = 48, extra_sfa = 56,
    extra_b = 64, extra_sfb = 72, extra_a_rows = 80, groups = 88, n = 92, k = 96, m_max = 100,
    first_extra = 104, k_split = 108,
);

// SAFETY: `repr(C)` plain data mirroring `GemvFp8Params` in grouped_gemv_fp8.cu (size asserted
// both sides, offsets here).
unsafe impl crate::cuda::KernelParams for GemvFp8Params {}

/// Launches `grouped_gemv_fp8` with `params` filled and checked by [`run`]: one grid sized to
/// the device, whose warps (or teams of warps sharing K, [`super::gemv_k_split`]) take (active group,
/// 16 weight rows) units in turn.
fn launch_gemv(stream: &Arc<CudaStream>, mut params: GemvFp8Params) -> Result<()> {
    let kernels = crate::cuda::Kernels::for_stream(stream)?;
    let warps = GEMV_THREADS / 32;
    let units = params.groups as u64 * (params.n as u64 / 16);
    let resident = u64::from(kernels.props().sm_count) * u64::from(GEMV_BLOCKS_PER_SM * warps);
    let split = super::gemv_k_split(units, (params.k as u64).div_ceil(128), resident);
    params.k_split = split as i32;
    let name = if split > 1 {
        "grouped_gemv_fp8_split_k"
    } else {
        "grouped_gemv_fp8"
    };
    let kernel = kernels.kernel(GEMV_FILE, name)?;
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (
            crate::cuda::grid_for(
                units * u64::from(split),
                u64::from(warps),
                kernels.props(),
                GEMV_BLOCKS_PER_SM,
            ),
            1,
            1,
        ),
        block_dim: (GEMV_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` mirrors `GemvFp8Params`; the caller checked every operand's length
    // against the shape (`a` and its scales by block, `b` and `extra_b` with their scales
    // `[groups, n, k]` in two parts, `d` `[groups * m_max, n]`, `counts` `[groups]`, `extra_a`
    // its rows), the 16-byte alignment of the e4m3 operands and `d` and the 4-byte alignment of
    // the scales, the masked layout and `k % 64 == 0`, and holds their guards until the launch
    // is queued; the kernel reads only rows below each group's count, which it checks against
    // `m_max` and the rows of `extra_a` (trapping otherwise), and writes only those rows of `d`.
    unsafe { kernel.launch(stream, cfg, params) }
}

/// The cubin of `fp8/dequantize.cu`.
const DEQUANTIZE_FILE: &str = "gemm/fp8/dequantize";
/// Threads per block (`kThreads` in `dequantize.cu`).
const DEQUANTIZE_THREADS: u32 = 256;
/// Values per thread and grid-stride step (`kPerThread`).
const DEQUANTIZE_PER_THREAD: u64 = 16;

/// Mirror of `struct DequantizeWeightParams` in `fp8/dequantize.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DequantizeWeightParams {
    q: CUdeviceptr,
    scales: CUdeviceptr,
    out: CUdeviceptr,
    n: i64,
    k: i64,
    scale_rows: i32,
    scale_cols: i32,
}
crate::cuda::assert_params_layout!(
    DequantizeWeightParams,
    48;
    q = 0, scales = 8, out = 16, n = 24, k = 32, scale_rows = 40, scale_cols = 44,
);

// SAFETY: `repr(C)` plain data mirroring `DequantizeWeightParams` in dequantize.cu (size
// asserted both sides, offsets here).
unsafe impl crate::cuda::KernelParams for DequantizeWeightParams {}

/// Dequantizes a `[n, k]` e4m3 weight with `scale_rows x 128` scale blocks
/// (`[ceil(n / scale_rows), ceil(k / 128)]` f32) into `out` (`[n, k]` bf16) on `stream`:
/// `bf16(f32(q) * scale)`, bit-identical to [`super::dequantize_weight`] rounded to bf16.
/// `k` must be a multiple of 16, `q` and `out` 16-byte aligned.
pub fn dequantize_weight_cuda(
    stream: &Arc<CudaStream>,
    q: &impl DevicePtr<F8E4M3>,
    scales: &impl DevicePtr<f32>,
    n: usize,
    k: usize,
    scale_rows: usize,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    if k == 0 || k % 16 != 0 {
        return Err(Error::invalid("k", k, "must be a positive multiple of 16"));
    }
    if scale_rows == 0 || scale_rows > i32::MAX as usize {
        return Err(Error::invalid(
            "scale_rows",
            scale_rows,
            "must be in 1..2^31",
        ));
    }
    let (sr, sc) = weight_scale_dims(n, k, scale_rows);
    Error::check_len("q", n * k, q.len())?;
    Error::check_len("scales", sr * sc, scales.len())?;
    Error::check_len("out", n * k, out.len())?;
    if n == 0 {
        return Ok(());
    }
    let kernels = crate::cuda::Kernels::for_stream(stream)?;
    let kernel = kernels.kernel(DEQUANTIZE_FILE, "dequantize_weight_fp8")?;
    stream.context().bind_to_thread()?;
    let (q_ptr, _gq) = q.device_ptr(stream);
    let (s_ptr, _gs) = scales.device_ptr(stream);
    let (o_ptr, _go) = out.device_ptr_mut(stream);
    check_align("q", q_ptr, 16)?;
    check_align("out", o_ptr, 16)?;
    check_align("scales", s_ptr, 4)?;
    let params = DequantizeWeightParams {
        q: q_ptr,
        scales: s_ptr,
        out: o_ptr,
        n: n as i64,
        k: k as i64,
        scale_rows: scale_rows as i32,
        scale_cols: sc as i32,
    };
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (
            crate::cuda::grid_for(
                (n * k) as u64 / DEQUANTIZE_PER_THREAD,
                u64::from(DEQUANTIZE_THREADS),
                kernels.props(),
                8,
            ),
            1,
            1,
        ),
        block_dim: (DEQUANTIZE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` mirrors `DequantizeWeightParams`; `q`, `scales` and `out` hold the
    // elements of a `[n, k]` weight and its scales (checked above), `q` and `out` are 16-byte
    // aligned, and their guards keep them alive and in stream order until the launch is
    // queued; the kernel touches `n * k / 16` vectors of each.
    unsafe { kernel.launch(stream, cfg, params) }
}

/// The cubin of `fp8/quantize_rows.cu`.
const ROWS_FILE: &str = "gemm/fp8/quantize_rows";

/// Mirror of `struct RowsParams` in `fp8/quantize_rows.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RowsParams {
    input: CUdeviceptr,
    q: CUdeviceptr,
    scales: CUdeviceptr,
    counts: CUdeviceptr,
    rows: i64,
    cols: i32,
    m_max: i32,
}
crate::cuda::assert_params_layout!(
    RowsParams,
    48;
    input = 0, q = 8, scales = 16, counts = 24, rows = 32, cols = 40, m_max = 44,
);

// SAFETY: `repr(C)` plain data mirroring `RowsParams` in quantize_rows.cu (size asserted both
// sides, offsets here).
unsafe impl crate::cuda::KernelParams for RowsParams {}

/// The mask of a masked layout: the device counts (`[rows / m_max]` i32) and `m_max`; the row
/// kernels visit only the rows within each block's count.
pub type RowsMask<'a> = (&'a dyn DevicePtr<i32>, usize);

/// The experts' input rows quantized on `stream`: `x` (`[rows, cols]` bf16) to `q`
/// (`[rows, cols]` e4m3) and `scales` (`[rows, cols / 128]` f32), 1 x 128 as the per-token
/// fp8 cast, bit for bit; with `mask` only the rows within each block's count (the others'
/// outputs are not written). Host twin: [`super::quantize_rows`].
pub fn quantize_rows_fp8_cuda(
    stream: &Arc<CudaStream>,
    x: &impl DevicePtr<bf16>,
    rows: usize,
    cols: usize,
    mask: Option<RowsMask<'_>>,
    q: &mut impl DevicePtrMut<F8E4M3>,
    scales: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    Error::check_len("x", rows * cols, x.len())?;
    launch_rows(stream, "quantize_rows_fp8", x, rows, cols, mask, q, scales)
}

/// The fp8 experts' SwiGLU and its quantization for the down GEMM on `stream`: for every row of
/// `h` (`[rows, 2 * inter]` bf16, gate columns then up columns) and every 128 columns of
/// `act = silu(gate) * up`, writes `q` (`[rows, inter]` e4m3) and `scales`
/// (`[rows, inter / 128]` f32) as the per-token fp8 cast would; with `mask` only the rows
/// within each block's count. Host twin: [`super::swiglu_quantize`].
pub fn swiglu_quantize_fp8_cuda(
    stream: &Arc<CudaStream>,
    h: &impl DevicePtr<bf16>,
    rows: usize,
    inter: usize,
    mask: Option<RowsMask<'_>>,
    q: &mut impl DevicePtrMut<F8E4M3>,
    scales: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    Error::check_len("h", rows * 2 * inter, h.len())?;
    launch_rows(
        stream,
        "swiglu_quantize_fp8",
        h,
        rows,
        inter,
        mask,
        q,
        scales,
    )
}

/// The checks and launch of a row kernel of `quantize_rows.cu` over `rows` rows of `cols`
/// outputs (its input's length checked by the caller).
#[allow(clippy::too_many_arguments)]
fn launch_rows(
    stream: &Arc<CudaStream>,
    kernel: &str,
    input: &impl DevicePtr<bf16>,
    rows: usize,
    cols: usize,
    mask: Option<RowsMask<'_>>,
    q: &mut impl DevicePtrMut<F8E4M3>,
    scales: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    if cols == 0 || cols % FP8_BLOCK != 0 || cols > i32::MAX as usize {
        return Err(Error::invalid(
            "cols",
            cols,
            format!("must be a positive multiple of {FP8_BLOCK} below 2^31"),
        ));
    }
    Error::check_len("q", rows * cols, q.len())?;
    Error::check_len("scales", rows * cols / FP8_BLOCK, scales.len())?;
    let m_max = match mask {
        Some((counts, m_max)) => {
            if m_max == 0 || m_max > i32::MAX as usize || counts.len() * m_max != rows {
                return Err(Error::invalid(
                    "mask",
                    format!("{} counts of m_max {m_max}", counts.len()),
                    format!("must cover the {rows} rows"),
                ));
            }
            if counts.len() > 65535 {
                return Err(Error::invalid("mask", counts.len(), "at most 65535 blocks"));
            }
            m_max as i32
        }
        None => 0,
    };
    if rows == 0 {
        return Ok(());
    }
    let kernels = crate::cuda::Kernels::for_stream(stream)?;
    let function = kernels.kernel(ROWS_FILE, kernel)?;
    stream.context().bind_to_thread()?;
    let mut guards = Vec::new();
    let c_ptr = opt_ptr(mask.map(|(c, _)| c), stream, &mut guards);
    let (i_ptr, _gi) = input.device_ptr(stream);
    let (q_ptr, _gq) = q.device_ptr_mut(stream);
    let (s_ptr, _gs) = scales.device_ptr_mut(stream);
    check_align("input", i_ptr, 8)?;
    check_align("q", q_ptr, 4)?;
    check_align("scales", s_ptr, 4)?;
    let params = RowsParams {
        input: i_ptr,
        q: q_ptr,
        scales: s_ptr,
        counts: c_ptr,
        rows: rows as i64,
        cols: cols as i32,
        m_max,
    };
    // One warp per (row, 128 columns); masked: one grid row per block (blockIdx.y), each
    // sized for a full block of rows.
    let warps_per_block = 256 / 32;
    let (row_items, grid_y) = match mask {
        Some((counts, m)) => (m * cols / FP8_BLOCK, counts.len() as u32),
        None => (rows * cols / FP8_BLOCK, 1),
    };
    let blocks = crate::cuda::grid_for(row_items as u64, warps_per_block, kernels.props(), 8);
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (blocks.div_ceil(grid_y).max(1), grid_y, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `params` mirrors `RowsParams`; the input, `q` and `scales` hold the elements of
    // `rows` rows (checked here and by the caller) with the alignments the kernels' vector
    // accesses need, and `counts` (when given) one entry per block of `m_max` rows; their
    // guards keep them alive and in stream order until the launch is queued.
    let launched = unsafe { function.launch(stream, cfg, params) };
    drop(guards);
    launched
}
