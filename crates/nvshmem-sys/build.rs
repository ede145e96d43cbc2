//! Build script of `nvshmem-sys`.
//!
//! Without the `cuda` feature it does nothing. With it, `csrc/shim.cu` becomes
//! `$OUT_DIR/libep_nvshmem_shim.so`, which `src/shim.rs` embeds with `include_bytes!`:
//!
//! 1. `nvcc -rdc=true -c` (sm_90a, C++17, `-fPIC`, hidden visibility) with NVSHMEM's headers
//!    and CUDA's `include/cccl` (NVSHMEM 3.4's headers include `<cuda/std/tuple>`);
//! 2. `nvcc -dlink` of that object with `libnvshmem_device.a` (NVSHMEM's device code, and the
//!    host half of its init, `nvshmemi_init_thread`);
//! 3. the host compiler links both objects, `libnvshmem_device.a`, the static CUDA runtime
//!    (`libcudart_static.a`) and `libnvshmem_host.so.3` into a shared library whose only
//!    non-system `NEEDED` entry is `libnvshmem_host.so.3` and which exports only the
//!    `ep_nvshmem_*` functions (`--exclude-libs,ALL`, `--no-undefined`).
//!
//! Environment: `CUDA_ROOT` / `CUDA_HOME` / `CUDA_PATH` (else `nvcc` on `PATH`) locate the
//! toolchain; `NVSHMEM_HOME` (else `$CUDA_ROOT/nvshmem`, which `scripts/cuda-toolchain.sh`
//! links to the pinned `nvidia-nvshmem-cu13` wheel) locates NVSHMEM; `CXX` (else `c++`) is the
//! host linker; `EP_NVCC_FLAGS` adds nvcc flags. The NVSHMEM `lib/` folder used here is passed
//! to the crate as `NVSHMEM_SYS_BUILD_LIB_DIR`, the last place the run-time search looks.

use std::env;
use std::path::PathBuf;
use std::process::Command;

#[path = "../../build-support/cuda_toolchain.rs"]
mod cuda_toolchain;
use cuda_toolchain::{find_nvcc, CUDA_ROOT_VARS};

const ARCH: &str = "-gencode=arch=compute_90a,code=sm_90a";
const SHIM: &str = "libep_nvshmem_shim.so";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=csrc/shim.cu");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for var in CUDA_ROOT_VARS
        .iter()
        .chain(&["NVSHMEM_HOME", "CXX", "EP_NVCC_FLAGS", "PATH"])
    {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if let Err(msg) = build() {
        // A panic message is what cargo shows for a failed build script.
        panic!("nvshmem-sys build.rs: {msg}");
    }
}

fn build() -> Result<(), String> {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let out_dir = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let nvcc = find_nvcc()?;
    let cuda_root = cuda_toolchain::cuda_root(&nvcc)?;
    let nvshmem = cuda_toolchain::find_nvshmem(
        &cuda_root,
        &[
            "include/nvshmem.h",
            "lib/libnvshmem_device.a",
            "lib/libnvshmem_host.so.3",
        ],
    )?;
    let nvshmem_lib = nvshmem.join("lib");
    let cudart_dir = ["lib64", "lib"]
        .iter()
        .map(|d| cuda_root.join(d))
        .find(|d| d.join("libcudart_static.a").is_file())
        .ok_or_else(|| {
            format!(
                "libcudart_static.a not found under {}/lib64 or /lib (the shim links the static \
                 CUDA runtime); run `eval \"$(scripts/cuda-toolchain.sh)\"`",
                cuda_root.display()
            )
        })?;
    let extra: Vec<String> = env::var("EP_NVCC_FLAGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();

    let source = manifest.join("csrc").join("shim.cu");
    let object = out_dir.join("shim.o");
    let dlink = out_dir.join("shim_dlink.o");
    let shim = out_dir.join(SHIM);

    let mut compile = Command::new(&nvcc);
    compile
        .args([ARCH, "-O3", "-std=c++17", "-rdc=true", "-lineinfo"])
        .args(["-Xcompiler", "-fPIC,-fvisibility=hidden"])
        .arg(format!("-I{}", nvshmem.join("include").display()));
    let cccl = cuda_root.join("include").join("cccl");
    if cccl.is_dir() {
        compile.arg(format!("-I{}", cccl.display()));
    }
    compile
        .args(&extra)
        .arg("-c")
        .arg("-o")
        .arg(&object)
        .arg(&source);
    run("nvcc (compile csrc/shim.cu)", compile)?;

    let mut device_link = Command::new(&nvcc);
    device_link
        .args([ARCH, "-Xcompiler", "-fPIC", "-dlink", "-o"])
        .arg(&dlink)
        .arg(&object)
        .arg(format!("-L{}", nvshmem_lib.display()))
        .arg("-lnvshmem_device");
    run("nvcc -dlink (with libnvshmem_device.a)", device_link)?;

    let cxx = env::var("CXX").unwrap_or_else(|_| "c++".to_owned());
    let mut link = Command::new(&cxx);
    link.args(["-shared", "-s", "-o"])
        .arg(&shim)
        .arg(&object)
        .arg(&dlink)
        .arg(format!("-L{}", nvshmem_lib.display()))
        .arg("-l:libnvshmem_device.a")
        .arg("-l:libnvshmem_host.so.3")
        .arg(format!("-L{}", cudart_dir.display()))
        .args(["-lcudart_static", "-lrt", "-lpthread", "-ldl"])
        .arg(format!(
            "-Wl,-soname,{SHIM},--no-undefined,--exclude-libs,ALL"
        ));
    run(&format!("{cxx} (link {SHIM})"), link)?;

    println!(
        "cargo:rustc-env=NVSHMEM_SYS_BUILD_LIB_DIR={}",
        nvshmem_lib.display()
    );
    Ok(())
}

/// Runs one command; its output goes to the build log.
fn run(what: &str, mut cmd: Command) -> Result<(), String> {
    let shown = format!("{cmd:?}");
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {what}: {e}\n{shown}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("$ {shown}\n{stdout}{stderr}");
    if !out.status.success() {
        return Err(format!(
            "{what} failed ({}):\n{shown}\n{stdout}{stderr}",
            out.status
        ));
    }
    for line in stderr.lines().filter(|l| l.contains("warning")) {
        println!("cargo:warning={what}: {}", line.trim());
    }
    Ok(())
}
