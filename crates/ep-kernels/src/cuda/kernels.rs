//! Per-context cache of loaded modules and functions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::driver::{CudaContext, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;

use super::device_props::DeviceProps;
use super::embedded::CUBINS;
use super::entry_points::entry_points_of;
use super::launch::Kernel;
use crate::error::{Error, Result};

/// The compute capability the embedded cubins are built for (`sm_90a`).
const REQUIRED_CC: (i32, i32) = (9, 0);

/// The embedded cubin of `file` (path under `src/` without `.cu`, e.g. `"layout/layout"`).
pub fn cubin(file: &str) -> Option<&'static [u8]> {
    CUBINS.iter().find(|(k, _)| *k == file).map(|(_, b)| *b)
}

/// The kernels (`extern "C" __global__` functions) of the embedded cubin `file`, sorted, read
/// from its ELF symbols.
pub fn cubin_entry_points(file: &str) -> Result<Vec<String>> {
    entry_points_of(file, embedded_cubin(file)?)
}

/// The embedded cubin of `file`, or an error naming the embedded ones.
fn embedded_cubin(file: &str) -> Result<&'static [u8]> {
    cubin(file).ok_or_else(|| {
        Error::invalid(
            "file",
            format!("{file:?}"),
            format!("must name an embedded cubin: one of {:?}", cubin_names()),
        )
    })
}

/// The names of every embedded cubin, sorted.
pub fn cubin_names() -> Vec<&'static str> {
    CUBINS.iter().map(|(k, _)| *k).collect()
}

/// Modules and functions of one CUDA context, all loaded when the cache is created.
///
/// Obtain it with [`Kernels::get`] (or [`Kernels::for_stream`]); it is shared by every user of
/// the same context and keeps that context alive.
#[derive(Debug)]
pub struct Kernels {
    ctx: Arc<CudaContext>,
    props: DeviceProps,
    /// file -> loaded module.
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
    /// file -> kernel name -> function.
    kernels: Mutex<HashMap<String, HashMap<String, Arc<Kernel>>>>,
}

/// Every context's cache, keyed by the raw `CUcontext` (stable while we hold the context).
type Registry = Vec<(usize, Arc<Kernels>)>;

fn registry() -> MutexGuard<'static, Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY
        .get_or_init(|| Mutex::new(Vec::new()))
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Kernels {
    /// The cache of `ctx`, created on first call: device properties queried, device checked,
    /// and every kernel of every embedded cubin loaded (see [`Kernels::load_all`]).
    ///
    /// Fails if the device is not compute capability 9.0 (the cubins are `sm_90a` only).
    pub fn get(ctx: &Arc<CudaContext>) -> Result<Arc<Self>> {
        let key = ctx.cu_ctx() as usize;
        if let Some((_, k)) = registry().iter().find(|(k, _)| *k == key) {
            return Ok(k.clone());
        }
        let props = DeviceProps::query(ctx)?;
        if props.compute_capability != REQUIRED_CC {
            let (major, minor) = props.compute_capability;
            return Err(Error::invalid(
                "device",
                format!(
                    "ordinal {} with compute capability {major}.{minor}",
                    props.ordinal
                ),
                "ep-kernels embeds sm_90a cubins only: needs compute capability 9.0 (H100/H200)",
            ));
        }
        let kernels = Arc::new(Self {
            ctx: ctx.clone(),
            props,
            modules: Mutex::new(HashMap::new()),
            kernels: Mutex::new(HashMap::new()),
        });
        // Outside the registry's lock: the ranks' threads load their contexts side by side
        // (two threads of one context may both load; the later keeps the first's cache).
        kernels.load_all()?;
        let mut reg = registry();
        if let Some((_, k)) = reg.iter().find(|(k, _)| *k == key) {
            return Ok(k.clone());
        }
        reg.push((key, kernels.clone()));
        Ok(kernels)
    }

    /// Loads every kernel of every embedded cubin into this context (`cuModuleGetFunction`,
    /// then `cuFuncLoad`), before the context's first op. Under lazy module loading (CUDA's
    /// default) the first load of a kernel may wait for the kernels running on the device; a
    /// rank whose host thread waited there in the middle of an op, while its running kernel
    /// waits for a peer, would stall that peer too (docs/design.md, "Loading kernels").
    fn load_all(&self) -> Result<()> {
        for (file, bytes) in CUBINS {
            for name in entry_points_of(file, bytes)? {
                self.kernel(file, &name)?.load()?;
            }
        }
        Ok(())
    }

    /// The cache of `stream`'s context.
    pub fn for_stream(stream: &CudaStream) -> Result<Arc<Self>> {
        Self::get(stream.context())
    }

    /// Drops the registry's reference to `ctx`'s cache (modules unload once every [`Kernel`]
    /// handed out is dropped too). Returns whether there was one.
    pub fn evict(ctx: &Arc<CudaContext>) -> bool {
        let key = ctx.cu_ctx() as usize;
        let mut reg = registry();
        let before = reg.len();
        reg.retain(|(k, _)| *k != key);
        reg.len() != before
    }

    /// The context this cache belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device's properties.
    pub fn props(&self) -> &DeviceProps {
        &self.props
    }

    /// The module of the embedded cubin `file` (loaded with the cache, see [`Kernels::get`]).
    pub fn module(&self, file: &str) -> Result<Arc<CudaModule>> {
        let mut modules = lock(&self.modules);
        if let Some(m) = modules.get(file) {
            return Ok(m.clone());
        }
        let bytes = embedded_cubin(file)?;
        let module = self.ctx.load_module(Ptx::from_binary(bytes.to_vec()))?;
        modules.insert(file.to_owned(), module.clone());
        Ok(module)
    }

    /// The kernel `name` (its `extern "C"` symbol) of the cubin `file`, cached.
    pub fn kernel(&self, file: &str, name: &str) -> Result<Arc<Kernel>> {
        if let Some(k) = lock(&self.kernels).get(file).and_then(|m| m.get(name)) {
            return Ok(k.clone());
        }
        let module = self.module(file)?;
        let function = module.load_function(name).map_err(|e| {
            Error::invalid(
                "kernel",
                format!("{name:?}"),
                format!("must be an extern \"C\" __global__ function of {file}.cu ({e})"),
            )
        })?;
        let kernel = Arc::new(Kernel::new(
            file,
            name,
            function,
            self.ctx.clone(),
            self.props,
        ));
        let mut kernels = lock(&self.kernels);
        let entry = kernels
            .entry(file.to_owned())
            .or_default()
            .entry(name.to_owned())
            .or_insert(kernel);
        Ok(entry.clone())
    }
}
