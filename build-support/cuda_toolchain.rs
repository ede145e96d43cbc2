//! Finding the CUDA toolchain from a build script: shared by the build scripts of
//! `ep-kernels` and `nvshmem-sys` (each includes this file with `#[path]`).

use std::env;
use std::path::{Path, PathBuf};

/// Variables that may hold the CUDA root, in order.
pub const CUDA_ROOT_VARS: [&str; 3] = ["CUDA_ROOT", "CUDA_HOME", "CUDA_PATH"];

/// nvcc from `CUDA_ROOT` / `CUDA_HOME` / `CUDA_PATH`, else from `PATH`; the error lists every
/// place tried.
pub fn find_nvcc() -> Result<PathBuf, String> {
    let mut tried = Vec::new();
    for var in CUDA_ROOT_VARS {
        if let Some(root) = env::var_os(var) {
            let nvcc = PathBuf::from(root).join("bin").join("nvcc");
            if nvcc.is_file() {
                return Ok(nvcc);
            }
            tried.push(format!("${var}/bin/nvcc = {} (missing)", nvcc.display()));
        } else {
            tried.push(format!("${var} (unset)"));
        }
    }
    if let Some(path) = env::var_os("PATH") {
        if let Some(nvcc) = env::split_paths(&path)
            .map(|d| d.join("nvcc"))
            .find(|p| p.is_file())
        {
            return Ok(nvcc);
        }
        tried.push("nvcc on $PATH (not found)".into());
    } else {
        tried.push("$PATH (unset)".into());
    }
    Err(format!(
        "the `cuda` feature needs nvcc, not found; tried: {}. Run `eval \"$(scripts/cuda-toolchain.sh)\"` \
         to install CUDA 13.0 and set CUDA_ROOT.",
        tried.join(", ")
    ))
}

/// The CUDA root of `nvcc` (the folder above its `bin/`).
pub fn cuda_root(nvcc: &Path) -> Result<PathBuf, String> {
    nvcc.parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .ok_or_else(|| {
            format!(
                "cannot derive the CUDA root from nvcc at {}",
                nvcc.display()
            )
        })
}

/// NVSHMEM's prefix: `NVSHMEM_HOME`, else `$CUDA_ROOT/nvshmem`, the first that holds every
/// file of `needed` (relative to the prefix); the error names both and how to get NVSHMEM.
pub fn find_nvshmem(cuda_root: &Path, needed: &[&str]) -> Result<PathBuf, String> {
    let candidates: Vec<PathBuf> = env::var_os("NVSHMEM_HOME")
        .map(PathBuf::from)
        .into_iter()
        .chain([cuda_root.join("nvshmem")])
        .collect();
    candidates
        .iter()
        .find(|p| needed.iter().all(|f| p.join(f).is_file()))
        .cloned()
        .ok_or_else(|| {
            format!(
                "NVSHMEM 3.x not found: none of {candidates:?} holds all of {needed:?}; set \
                 NVSHMEM_HOME to NVSHMEM's prefix (e.g. <venv>/lib/python3.12/site-packages/nvidia/nvshmem \
                 of the wheel nvidia-nvshmem-cu13==3.4.5) or run `eval \"$(scripts/cuda-toolchain.sh)\"`"
            )
        })
}
