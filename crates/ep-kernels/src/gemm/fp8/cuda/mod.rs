//! Launchers of the block-scaled fp8 grouped GEMMs (CUTLASS kernels of the host library,
//! `fp8/grouped_gemm_fp8_sm90.cuh`), of the experts' row quantizations (their input rows, and
//! SwiGLU with its quantization: `quantize_rows.cu`) and of the weight dequantization
//! (`dequantize.cu`). Host twins: [`super::host`].
//!
//! One module per kernel source: the C entry points of each CUTLASS configuration
//! (`grouped_fp8_wide.cu`, `grouped_fp8_narrow.cu`, `swiglu_fp8_wide.cu`) in the module of the
//! same name, launched by [`grouped_gemm_fp8_cuda`] and [`grouped_gemm_swiglu_fp8_cuda`] here; `grouped_gemv_fp8` (`grouped_gemv_fp8.cu`, the
//! tile-less GEMV); `dequantize` (`dequantize.cu`); `quantize_rows` (`quantize_rows.cu`).

mod dequantize;
mod grouped_fp8_narrow;
mod grouped_fp8_wide;
mod grouped_gemv_fp8;
mod quantize_rows;
mod swiglu_fp8_wide;

pub use dequantize::dequantize_weight_cuda;
pub use quantize_rows::{quantize_rows_fp8_cuda, swiglu_quantize_fp8_cuda, RowsMask};

use std::ffi::{c_char, CStr};
use std::sync::Arc;

use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use float8::F8E4M3;
use half::bf16;

use super::{check_shape, row_scale_cols, weight_scale_dims, FP8_BLOCK, FP8_GATE_UP_BLOCK};
use crate::cuda::check_align;
use crate::error::{Error, Result};
use crate::gemm::cuda::check_workspace;
use crate::gemm::{GemmTiles, GroupLayout, GroupedGemmShape, GroupedGemmWorkspace};
use grouped_fp8_narrow::{ep_grouped_gemm_fp8_narrow_run, ep_grouped_gemm_fp8_narrow_workspace};
use grouped_fp8_wide::{ep_grouped_gemm_fp8_wide_run, ep_grouped_gemm_fp8_wide_workspace};
use grouped_gemv_fp8::{check_gemv, launch_gemv, GemvFp8Params};
use swiglu_fp8_wide::{
    ep_grouped_gemm_fp8_swiglu_wide_run, ep_grouped_gemm_fp8_swiglu_wide_workspace,
};

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
    d_scales: CUdeviceptr,
}
const _: () = assert!(std::mem::size_of::<GroupedGemmFp8Args>() == 152);
const _: () = assert!(std::mem::offset_of!(GroupedGemmFp8Args, rows) == 64);
const _: () = assert!(std::mem::offset_of!(GroupedGemmFp8Args, first_extra) == 100);
const _: () = assert!(std::mem::offset_of!(GroupedGemmFp8Args, extra_a) == 104);
const _: () = assert!(std::mem::offset_of!(GroupedGemmFp8Args, extra_a_rows) == 136);
const _: () = assert!(std::mem::offset_of!(GroupedGemmFp8Args, d_scales) == 144);

type RunFn = unsafe extern "C" fn(*const GroupedGemmFp8Args, CUstream, *mut c_char, u64) -> i32;
type WorkspaceFn = unsafe extern "C" fn(i32, i32) -> u64;

/// The fp8 tile configurations and their `(tile, cluster)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fp8Tiles {
    /// 128 x 128 cooperative tiles, clusters of 2 along N.
    Wide,
    /// 64 x 128 ping-pong tiles, clusters of 2 along N.
    Narrow,
    /// The wide tiles with SwiGLU and the act quantization in the epilogue.
    SwigluWide,
}

impl Fp8Tiles {
    /// The configuration `tiles` asks for (`Auto` resolved as for bf16: narrow tiles for the
    /// masked layout, wide ones for the contiguous layout).
    fn from(tiles: GemmTiles, layout: GroupLayout, rows: usize, groups: usize) -> Result<Self> {
        match tiles.resolve(layout, rows, groups) {
            GemmTiles::Narrow => Ok(Fp8Tiles::Narrow),
            // One wide configuration in fp8: clusters along M measured slower
            // (docs/benchmarks.md, "Tried and rejected").
            GemmTiles::Wide | GemmTiles::WideM => Ok(Fp8Tiles::Wide),
            GemmTiles::Gemv => unreachable!("the caller launches the GEMV itself"),
            GemmTiles::Auto => unreachable!("resolve() resolves Auto"),
        }
    }

    fn shape(self) -> ((usize, usize), (usize, usize)) {
        match self {
            Fp8Tiles::Wide | Fp8Tiles::SwigluWide => ((128, 128), (1, 2)),
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
            Fp8Tiles::SwigluWide => (
                "grouped_gemm_fp8_swiglu_wide",
                ep_grouped_gemm_fp8_swiglu_wide_workspace,
                ep_grouped_gemm_fp8_swiglu_wide_run,
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
    [Fp8Tiles::Wide, Fp8Tiles::Narrow, Fp8Tiles::SwigluWide]
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
    run(
        stream,
        a,
        b,
        counts,
        shape,
        extra,
        tiles,
        Output::Products(d),
        workspace,
    )
}

/// The experts' gate_up GEMM with SwiGLU and the down GEMM's row quantization in its epilogue,
/// on `stream`: `b` the gate_up weights `[groups, n, k]` in [`FP8_GATE_UP_BLOCK`]-row gate and
/// up blocks in turn (`n = 2I`, a multiple of 256), and for every valid row `r` the products'
/// `act = silu(gate) * up` written as `act` (`[rows, n / 2]` e4m3) and `act_scales`
/// (`[rows, n / 256]` f32), 1 x 128 as the per-token cast computes them from the f32 products.
/// Contiguous or masked layout, no extra groups; the wide tiles (the kernel pairs the two CTAs
/// of a cluster, `swiglu_quantize_epilogue_sm90.cuh`). Host twin: [`super::grouped_gemm_swiglu_fp8`].
///
/// Checked before launch: as [`grouped_gemm_fp8_cuda`], and `n`.
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_swiglu_fp8_cuda(
    stream: &Arc<CudaStream>,
    a: &DeviceFp8<'_>,
    b: &DeviceFp8<'_>,
    counts: &impl DevicePtr<i32>,
    shape: &GroupedGemmShape,
    act: &mut impl DevicePtrMut<F8E4M3>,
    act_scales: &mut impl DevicePtrMut<f32>,
    workspace: &mut GroupedGemmWorkspace,
) -> Result<()> {
    let pair = 2 * FP8_GATE_UP_BLOCK;
    if shape.n == 0 || shape.n % pair != 0 {
        return Err(Error::invalid(
            "shape.n",
            shape.n,
            format!("must be a positive multiple of {pair} (gate and up blocks of {FP8_GATE_UP_BLOCK} rows)"),
        ));
    }
    let output: Output<'_, cudarc::driver::CudaSlice<bf16>> = Output::Act {
        q: act,
        scales: act_scales,
    };
    run(
        stream,
        a,
        b,
        counts,
        shape,
        None,
        GemmTiles::Wide,
        output,
        workspace,
    )
}

/// The experts' gate_up GEMM with SwiGLU and the down GEMM's row quantization fused, by the
/// tile-less GEMV ([`GemmTiles::Gemv`]: masked layout, blocks of a few rows; no pass between the
/// GEMVs of a decode step), on `stream`: the function of [`grouped_gemm_swiglu_fp8_cuda`] (`b`
/// in [`FP8_GATE_UP_BLOCK`]-row gate and up blocks in turn, `n = 2I` a multiple of 256 up to
/// [`super::GEMV_SWIGLU_MAX_ACT_BLOCKS`] x 256), with extra groups as
/// [`grouped_gemm_fp8_cuda`] takes them. `products` (`[rows, n / 2]` f32) is its scratch: the
/// act values before their quantization. Host twin: [`super::grouped_gemm_swiglu_fp8`].
///
/// Checked before launch: as [`grouped_gemm_fp8_cuda`] with `GemmTiles::Gemv`, and `n`.
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemv_swiglu_fp8_cuda(
    stream: &Arc<CudaStream>,
    a: &DeviceFp8<'_>,
    b: &DeviceFp8<'_>,
    counts: &impl DevicePtr<i32>,
    shape: &GroupedGemmShape,
    extra: Option<&ExtraGroupsFp8<'_>>,
    act: &mut impl DevicePtrMut<F8E4M3>,
    act_scales: &mut impl DevicePtrMut<f32>,
    products: &mut impl DevicePtrMut<f32>,
    workspace: &mut GroupedGemmWorkspace,
) -> Result<()> {
    if !super::gemv_swiglu_takes(shape.n) {
        let pair = 2 * FP8_GATE_UP_BLOCK;
        let most = super::GEMV_SWIGLU_MAX_ACT_BLOCKS * pair;
        return Err(Error::invalid(
            "shape.n",
            shape.n,
            format!("must be a positive multiple of {pair} (gate and up blocks of {FP8_GATE_UP_BLOCK} rows) up to {most}"),
        ));
    }
    let output: Output<'_, cudarc::driver::CudaSlice<bf16>> = Output::GemvAct {
        q: act,
        scales: act_scales,
        products,
    };
    run(
        stream,
        a,
        b,
        counts,
        shape,
        extra,
        GemmTiles::Gemv,
        output,
        workspace,
    )
}

/// What an fp8 GEMM writes.
enum Output<'a, D> {
    /// The bf16 products `[rows, n]`.
    Products(&'a mut D),
    /// SwiGLU's act `[rows, n / 2]` e4m3 and its scales `[rows, n / 256]` (CUTLASS epilogue).
    Act {
        q: &'a mut dyn DevicePtrMut<F8E4M3>,
        scales: &'a mut dyn DevicePtrMut<f32>,
    },
    /// The same by the tile-less GEMV, through its f32 scratch `products` `[rows, n / 2]`.
    GemvAct {
        q: &'a mut dyn DevicePtrMut<F8E4M3>,
        scales: &'a mut dyn DevicePtrMut<f32>,
        products: &'a mut dyn DevicePtrMut<f32>,
    },
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
    output: Output<'_, impl DevicePtrMut<bf16>>,
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
    let fused = matches!(output, Output::Act { .. });
    let gemv_fused = matches!(output, Output::GemvAct { .. });
    match &output {
        Output::Products(d) => Error::check_len("d", rows * n, d.len())?,
        Output::Act { q, scales } => {
            Error::check_len("act", rows * n / 2, q.len())?;
            Error::check_len("act scales", rows * n / 2 / FP8_BLOCK, scales.len())?;
        }
        Output::GemvAct {
            q,
            scales,
            products,
        } => {
            Error::check_len("act", rows * n / 2, q.len())?;
            Error::check_len("act scales", rows * n / 2 / FP8_BLOCK, scales.len())?;
            Error::check_len("products", rows * n / 2, products.len())?;
        }
    }
    check_workspace(workspace, stream, groups)?;
    if rows == 0 {
        return Ok(());
    }
    let gemv = gemv_fused || (!fused && tiles.resolve(layout, rows, groups) == GemmTiles::Gemv);
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
    let mut guards = Vec::new();
    // (d or act, act scales, f32 products)
    let (d_ptr, ds_ptr, p_ptr) = match output {
        Output::Products(d) => {
            let (p, g) = d.device_ptr_mut(stream);
            guards.push(g);
            (p, 0, 0)
        }
        Output::Act { q, scales } => {
            let (p, g) = q.device_ptr_mut(stream);
            guards.push(g);
            let (ps, gs) = scales.device_ptr_mut(stream);
            guards.push(gs);
            (p, ps, 0)
        }
        Output::GemvAct {
            q,
            scales,
            products,
        } => {
            let (p, g) = q.device_ptr_mut(stream);
            guards.push(g);
            let (ps, gs) = scales.device_ptr_mut(stream);
            guards.push(gs);
            let (pp, gp) = products.device_ptr_mut(stream);
            guards.push(gp);
            check_align("products", pp, 16)?;
            (p, ps, pp)
        }
    };
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
        ("act scales", ds_ptr),
        ("extra.a scales", xsa_ptr),
        ("extra.b scales", xsb_ptr),
    ] {
        if p != 0 {
            check_align(arg, p, 4)?;
        }
    }
    if gemv {
        let (arrivals, _garr) = workspace.arrivals.device_ptr_mut(stream);
        let params = GemvFp8Params {
            a: a_ptr,
            sfa: sfa_ptr,
            b: b_ptr,
            sfb: sfb_ptr,
            d: if gemv_fused { 0 } else { d_ptr },
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
            act: p_ptr,
            q: if gemv_fused { d_ptr } else { 0 },
            q_scales: ds_ptr,
            arrivals: if gemv_fused { arrivals } else { 0 },
        };
        let launched = launch_gemv(stream, params, gemv_fused);
        drop(guards);
        return launched;
    }
    let tiles = if fused {
        Fp8Tiles::SwigluWide
    } else {
        Fp8Tiles::from(tiles, layout, rows, groups)?
    };
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
        d_scales: ds_ptr,
    };
    let mut message = [0 as c_char; 256];
    // SAFETY: `args` mirrors `GroupedGemmFp8Args` (size and offsets asserted); every operand
    // and scale tensor, and the output (`d`, or the act values and their scales with the
    // SwiGLU epilogue, whose entry point also checks `n` and the scales' pointer), holds the
    // elements the shape implies (checked above) and stays borrowed,
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
