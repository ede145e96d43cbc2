//! Build script of `ep-kernels`.
//!
//! Without the `cuda` feature it does nothing. With it, every `src/**/*.cu` is compiled by
//! nvcc into one sm_90a cubin (`-I csrc`), and `$OUT_DIR/cubins.rs` is generated: a static
//! table `CUBINS: &[(&str, &[u8])]` of `("<path under src without .cu>", include_bytes!(..))`,
//! e.g. `("layout/layout", ..)`, which `src/cuda/` loads at run time.
//!
//! Headers (`.cuh`) are never compiled on their own. A header of one mode lives beside its
//! kernels (`src/intranode/intranode.cuh`), found by quoted includes relative to the including
//! file (`"../intranode/intranode.cuh"` from `src/internode/`); `csrc/` holds the headers every
//! mode shares (`common.cuh`). A cubin is rebuilt when its source, a header of its folder, a
//! header it includes from another folder, or a header of `csrc/` changes.
//!
//! Files that include an NVSHMEM header (`#include <nvshmem...>`) are built with the `nvshmem`
//! feature only: compiled with `-rdc=true` and device-linked with `libnvshmem_device.a` (from
//! `NVSHMEM_HOME`, else `$CUDA_ROOT/nvshmem`) into the cubin.
//!
//! Files whose first line is `// ep-kernels: host library (CUTLASS)` are not cubins: they hold
//! CUTLASS kernels together with the host code that builds their parameters (TMA descriptors)
//! and launches them through the CUDA runtime. Each is compiled to an object file with the
//! CUTLASS headers (from `CUTLASS_HOME`, else `$CUDA_ROOT/cutlass`, which
//! `scripts/cuda-toolchain.sh` links to the pinned `nvidia-cutlass` wheel), the objects are
//! archived into `libep_kernels_host.a`, and the crate links it with the static CUDA runtime
//! (`libcudart_static.a` of the toolchain) and the C++ standard library. Their C entry points
//! are declared in the Rust launchers (`src/gemm/cuda/`, `src/gemm/fp8/cuda/`).
//!
//! Environment: `CUDA_ROOT` / `CUDA_HOME` / `CUDA_PATH` (else `nvcc` on `PATH`) locate the
//! toolchain (`scripts/cuda-toolchain.sh` prints them); `EP_NVCC_FLAGS` adds flags (e.g. `-G`,
//! `-DEP_DEBUG`). ptxas resource usage (`-Xptxas -v`) is written to the build log
//! (`target/*/build/ep-kernels-*/output`); spills and compiler warnings become cargo warnings.

use std::collections::hash_map::DefaultHasher;
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "../../build-support/cuda_toolchain.rs"]
mod cuda_toolchain;
use cuda_toolchain::{find_nvcc, CUDA_ROOT_VARS};

const BASE_FLAGS: [&str; 6] = [
    "-gencode=arch=compute_90a,code=sm_90a",
    "-O3",
    "-std=c++17",
    "-lineinfo",
    "-Xptxas",
    "-v",
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for var in CUDA_ROOT_VARS
        .iter()
        .chain(&["EP_NVCC_FLAGS", "NVSHMEM_HOME", "CUTLASS_HOME"])
    {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if let Err(msg) = build() {
        // A panic message is what cargo shows for a failed build script.
        panic!("ep-kernels build.rs: {msg}");
    }
}

/// One `.cu` file to compile.
struct Source {
    /// Path under `src/` without the extension, with `/` separators: the table key.
    key: String,
    path: PathBuf,
    uses_nvshmem: bool,
    /// Compiled to an object of `libep_kernels_host.a` (CUTLASS + host launch code).
    host_library: bool,
}

/// Extra nvcc flags of host-library sources (CUTLASS needs relaxed constexpr; the objects go
/// into a static library linked into position-independent executables).
const HOST_LIBRARY_FLAGS: [&str; 4] = [
    "--expt-relaxed-constexpr",
    "-DNDEBUG",
    "-Xcompiler",
    "-fPIC",
];

/// The first line that marks a source as part of the host library.
const HOST_LIBRARY_MARKER: &str = "// ep-kernels: host library (CUTLASS)";

fn build() -> Result<(), String> {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").map_err(|e| e.to_string())?);
    let out_dir = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let nvcc = find_nvcc()?;
    let cuda_root = cuda_toolchain::cuda_root(&nvcc)?;
    let csrc = manifest.join("csrc");
    println!("cargo:rerun-if-changed={}", csrc.display());
    for header in list_files(&csrc, &["cuh", "h"])? {
        println!("cargo:rerun-if-changed={}", header.display());
    }

    let src = manifest.join("src");
    // Kernels that use NVSHMEM are built with the `nvshmem` feature only.
    let with_nvshmem = env::var_os("CARGO_FEATURE_NVSHMEM").is_some();
    let mut sources = Vec::new();
    for path in list_files(&src, &["cu"])? {
        println!("cargo:rerun-if-changed={}", path.display());
        let rel = path
            .strip_prefix(&src)
            .map_err(|e| e.to_string())?
            .with_extension("");
        let key = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join("/");
        let text = fs::read_to_string(&path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let uses_nvshmem = text.lines().any(|l| {
            let l = l.trim_start();
            l.starts_with("#include") && l.contains("nvshmem")
        });
        if uses_nvshmem && !with_nvshmem {
            continue;
        }
        let host_library = text
            .lines()
            .next()
            .is_some_and(|l| l.trim() == HOST_LIBRARY_MARKER);
        sources.push(Source {
            key,
            path,
            uses_nvshmem,
            host_library,
        });
    }
    // Watch `src/` too (cargo scans it recursively), so that a new .cu file is picked up. Any
    // Rust edit then reruns this script, which is why unchanged cubins come from the cache.
    println!("cargo:rerun-if-changed={}", src.display());
    // The mode headers beside the kernels (covered by `src/` already; named for clarity).
    for header in list_files(&src, &["cuh", "h"])? {
        println!("cargo:rerun-if-changed={}", header.display());
    }
    let mut headers_text = String::new();
    for header in list_files(&csrc, &["cuh", "h"])? {
        headers_text.push_str(
            &fs::read_to_string(&header)
                .map_err(|e| format!("cannot read {}: {e}", header.display()))?,
        );
    }

    let extra: Vec<String> = env::var("EP_NVCC_FLAGS")
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    let mut include_flags = vec![format!("-I{}", csrc.display())];
    let cccl = cuda_root.join("include").join("cccl");
    if cccl.is_dir() {
        include_flags.push(format!("-I{}", cccl.display()));
    }
    let cutlass = if sources.iter().any(|s| s.host_library) {
        let root = find_cutlass(&cuda_root)?;
        let version = fs::read_to_string(root.join("include/cutlass/version.h")).map_err(|e| {
            format!(
                "cannot read CUTLASS's version.h under {}: {e}",
                root.display()
            )
        })?;
        headers_text.push_str(&version);
        Some(root)
    } else {
        None
    };
    let ctx = Ctx {
        headers_text: &headers_text,
        nvcc: &nvcc,
        cuda_root: &cuda_root,
        out_dir: &out_dir,
        include_flags: &include_flags,
        extra: &extra,
        cutlass: cutlass.as_deref(),
    };

    // Compile in parallel, as many at once as cargo allows for this build.
    let jobs = env::var("NUM_JOBS")
        .ok()
        .and_then(|j| j.parse::<usize>().ok())
        .unwrap_or(1)
        .max(1);
    let mut results: Vec<Result<(PathBuf, String), String>> = Vec::with_capacity(sources.len());
    for chunk in sources.chunks(jobs) {
        let chunk_results: Vec<Result<(PathBuf, String), String>> = std::thread::scope(|s| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|source| s.spawn(|| ctx.compile(source)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("nvcc worker thread panicked".into()))
                })
                .collect()
        });
        results.extend(chunk_results);
    }

    let mut table = String::from(
        "/// Every embedded cubin: (path under `src/` without `.cu`, sm_90a cubin bytes).\n\
         pub(crate) static CUBINS: &[(&str, &[u8])] = &[\n",
    );
    let mut errors = Vec::new();
    let mut objects = Vec::new();
    for (source, result) in sources.iter().zip(results) {
        match result {
            Ok((object, log)) if source.host_library => {
                println!("== nvcc {} (host library)", source.key);
                report(&source.key, &log);
                objects.push(object);
            }
            Ok((cubin, log)) => {
                println!("== nvcc {}", source.key);
                report(&source.key, &log);
                writeln!(
                    table,
                    "    ({:?}, include_bytes!({:?})),",
                    source.key,
                    cubin.display().to_string()
                )
                .map_err(|e| e.to_string())?;
            }
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        return Err(errors.join("\n\n"));
    }
    table.push_str("];\n");
    fs::write(out_dir.join("cubins.rs"), table)
        .map_err(|e| format!("cannot write cubins.rs: {e}"))?;
    if !objects.is_empty() {
        link_host_library(&out_dir, &cuda_root, &objects)?;
    }
    Ok(())
}

/// Archives the host-library objects into `libep_kernels_host.a` and links it, with the static
/// CUDA runtime and the C++ standard library.
fn link_host_library(out_dir: &Path, cuda_root: &Path, objects: &[PathBuf]) -> Result<(), String> {
    let lib = out_dir.join("libep_kernels_host.a");
    let _ = fs::remove_file(&lib);
    let out = Command::new("ar")
        .arg("crs")
        .arg(&lib)
        .args(objects)
        .output()
        .map_err(|e| format!("cannot run ar: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "ar failed on {}: {}",
            lib.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let runtime = ["lib64", "lib"]
        .iter()
        .map(|d| cuda_root.join(d))
        .find(|d| d.join("libcudart_static.a").is_file())
        .ok_or_else(|| {
            format!(
                "libcudart_static.a not found under {}/lib64 or /lib (the host library links the \
                 static CUDA runtime)",
                cuda_root.display()
            )
        })?;
    println!("cargo:rustc-link-search=native={}", out_dir.display());
    println!("cargo:rustc-link-lib=static=ep_kernels_host");
    println!("cargo:rustc-link-search=native={}", runtime.display());
    println!("cargo:rustc-link-lib=static=cudart_static");
    for lib in ["stdc++", "dl", "rt", "pthread"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
    Ok(())
}

/// What every compilation shares.
struct Ctx<'a> {
    /// All shared headers, concatenated (part of every cache key).
    headers_text: &'a str,
    nvcc: &'a Path,
    cuda_root: &'a Path,
    out_dir: &'a Path,
    include_flags: &'a [String],
    extra: &'a [String],
    /// CUTLASS's source root (with `include/` and `tools/util/include/`), when a host-library
    /// source needs it.
    cutlass: Option<&'a Path>,
}

impl Ctx<'_> {
    /// Compiles one source into `$OUT_DIR/<key with / -> __>.cubin`; returns the cubin path
    /// and the compiler log.
    ///
    /// A cubin whose inputs (source, the files of its folder, the headers it includes from
    /// other folders, shared headers, nvcc path and flags) hash to the value
    /// stored beside it is reused, and its saved compiler log replayed.
    fn compile(&self, source: &Source) -> Result<(PathBuf, String), String> {
        let stem = source.key.replace('/', "__");
        let ext = if source.host_library { "o" } else { "cubin" };
        let cubin = self.out_dir.join(format!("{stem}.{ext}"));
        let stamp = self.out_dir.join(format!("{stem}.{ext}.key"));
        let log_path = self.out_dir.join(format!("{stem}.{ext}.log"));
        let text = fs::read_to_string(&source.path)
            .map_err(|e| format!("cannot read {}: {e}", source.path.display()))?;
        // What the source may include beside the shared headers: every .cuh / .h of its own
        // folder (e.g. `low_latency/protocol.cuh`), and for an NVSHMEM source the .cu files too
        // (`combine.cu` for `combine_nvshmem.cu`). Other kernels of the folder are not part of
        // the key, so that editing one does not rebuild its neighbours.
        let mut siblings = String::new();
        let sibling_exts: &[&str] = if source.uses_nvshmem {
            &["cu", "cuh", "h"]
        } else {
            &["cuh", "h"]
        };
        if let Some(dir) = source.path.parent() {
            for file in list_files(dir, sibling_exts)? {
                if file.parent() == Some(dir) {
                    siblings.push_str(
                        &fs::read_to_string(&file)
                            .map_err(|e| format!("cannot read {}: {e}", file.display()))?,
                    );
                }
            }
        }
        // Headers of other folders it includes (`../intranode/intranode.cuh`), directly or
        // through a header.
        let mut included = String::new();
        for file in quoted_includes(&source.path)? {
            if file.parent() != source.path.parent() {
                included.push_str(
                    &fs::read_to_string(&file)
                        .map_err(|e| format!("cannot read {}: {e}", file.display()))?,
                );
            }
        }
        let key = {
            let mut h = DefaultHasher::new();
            (
                text.as_str(),
                siblings.as_str(),
                included.as_str(),
                self.headers_text,
                self.nvcc,
                self.include_flags,
                self.extra,
            )
                .hash(&mut h);
            BASE_FLAGS.hash(&mut h);
            (source.host_library, self.cutlass, HOST_LIBRARY_FLAGS).hash(&mut h);
            format!("{:016x}", h.finish())
        };
        if cubin.is_file() && fs::read_to_string(&stamp).is_ok_and(|k| k == key) {
            let log = fs::read_to_string(&log_path).unwrap_or_default();
            return Ok((cubin, format!("(cached)\n{log}")));
        }
        let _ = fs::remove_file(&stamp);
        let mut log = String::new();
        let mut cmd = Command::new(self.nvcc);
        cmd.args(BASE_FLAGS)
            .args(self.include_flags)
            .args(self.extra);
        let mut link = None;
        if source.host_library {
            let cutlass = self.cutlass.ok_or("host library source without CUTLASS")?;
            cmd.args(HOST_LIBRARY_FLAGS)
                .arg(format!("-I{}", cutlass.join("include").display()))
                .arg(format!(
                    "-I{}",
                    cutlass.join("tools/util/include").display()
                ))
                .arg("-c")
                .arg("-o")
                .arg(&cubin);
        } else if source.uses_nvshmem {
            let nvshmem = cuda_toolchain::find_nvshmem(
                self.cuda_root,
                &["include/nvshmem.h", "lib/libnvshmem_device.a"],
            )?;
            let obj = self.out_dir.join(format!("{stem}.o"));
            cmd.arg("-rdc=true")
                .arg(format!("-I{}", nvshmem.join("include").display()))
                .arg("-c")
                .arg("-o")
                .arg(&obj);
            link = Some((obj, nvshmem));
        } else {
            cmd.arg("-cubin").arg("-o").arg(&cubin);
        }
        cmd.arg(&source.path);
        log.push_str(&self.run(&source.key, cmd)?);
        if let Some((obj, nvshmem)) = link {
            // Device link with NVSHMEM's device library into one loadable cubin.
            let mut cmd = Command::new(self.nvcc);
            cmd.arg("-gencode=arch=compute_90a,code=sm_90a")
                .arg("-dlink")
                .arg("-cubin")
                .arg("-o")
                .arg(&cubin)
                .arg(&obj)
                .arg(format!("-L{}", nvshmem.join("lib").display()))
                .arg("-lnvshmem_device");
            log.push_str(&self.run(&format!("{} (device link)", source.key), cmd)?);
        }
        fs::write(&log_path, &log)
            .map_err(|e| format!("cannot write {}: {e}", log_path.display()))?;
        fs::write(&stamp, &key).map_err(|e| format!("cannot write {}: {e}", stamp.display()))?;
        Ok((cubin, log))
    }

    /// Runs one nvcc command; returns its output (the command line first).
    fn run(&self, what: &str, mut cmd: Command) -> Result<String, String> {
        let shown = format!("{cmd:?}");
        let out = cmd
            .output()
            .map_err(|e| format!("cannot run nvcc at {}: {e}", self.nvcc.display()))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            return Err(format!(
                "nvcc failed on {what} ({}):\n{shown}\n{stdout}{stderr}",
                out.status
            ));
        }
        Ok(format!("$ {shown}\n{stdout}{stderr}"))
    }
}

/// Writes a compiler log to the build log (non-`cargo:` lines) and turns register spills and
/// compiler warnings into cargo warnings.
fn report(what: &str, log: &str) {
    let mut function = String::new();
    for line in log.lines() {
        println!("   {line}");
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            function = rest.trim().to_owned();
        }
        if line.contains("spill stores") && has_spills(line) {
            println!(
                "cargo:warning={what}: `{function}` spills registers: {}",
                line.trim()
            );
        }
        if line.contains("warning") && !line.starts_with("ptxas info") && !line.starts_with('$') {
            println!("cargo:warning={what}: {}", line.trim());
        }
    }
}

/// True when a ptxas line `N bytes stack frame, S bytes spill stores, L bytes spill loads`
/// reports a non-zero spill.
fn has_spills(line: &str) -> bool {
    let words: Vec<&str> = line.split_whitespace().collect();
    words.windows(3).any(|w| {
        w[1] == "bytes" && w[2] == "spill" && w[0].parse::<u64>().map(|n| n > 0).unwrap_or(false)
    })
}

/// CUTLASS's source root: `CUTLASS_HOME`, else `$CUDA_ROOT/cutlass` (made by
/// `scripts/cuda-toolchain.sh` from the pinned `nvidia-cutlass` wheel).
fn find_cutlass(cuda_root: &Path) -> Result<PathBuf, String> {
    let candidates: Vec<PathBuf> = env::var_os("CUTLASS_HOME")
        .map(PathBuf::from)
        .into_iter()
        .chain([cuda_root.join("cutlass")])
        .collect();
    candidates
        .iter()
        .find(|p| p.join("include/cutlass/cutlass.h").is_file())
        .cloned()
        .ok_or_else(|| {
            format!(
                "a host-library source needs CUTLASS 3 headers, not found under {candidates:?}; \
                 run `eval \"$(scripts/cuda-toolchain.sh)\"` (pins nvidia-cutlass) or set CUTLASS_HOME"
            )
        })
}

/// The files that `path` includes with `#include "..."`, directly or through one of them, each
/// name taken relative to the folder of the file that includes it (where nvcc looks first);
/// names not found there (`common.cuh` from `-I csrc`, CUTLASS) are left out. Sorted, each
/// once (`..` resolved lexically).
fn quoted_includes(path: &Path) -> Result<Vec<PathBuf>, String> {
    let mut found: Vec<PathBuf> = Vec::new();
    let mut todo = vec![path.to_path_buf()];
    while let Some(file) = todo.pop() {
        let text = fs::read_to_string(&file)
            .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
        let Some(dir) = file.parent() else {
            continue;
        };
        for line in text.lines() {
            let Some(rest) = line.trim_start().strip_prefix("#include") else {
                continue;
            };
            let Some(name) = rest
                .trim_start()
                .strip_prefix('"')
                .and_then(|r| r.split('"').next())
            else {
                continue;
            };
            let included = normalize(&dir.join(name));
            if included.is_file() && !found.contains(&included) {
                found.push(included.clone());
                todo.push(included);
            }
        }
    }
    found.sort();
    Ok(found)
}

/// `path` with its `.` and `name/..` components removed (no file system access), so that one
/// header reached along two routes is one path.
fn normalize(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir
                if matches!(out.components().next_back(), Some(Component::Normal(_))) =>
            {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// Files under `dir` (recursively) with one of `exts`, sorted.
fn list_files(dir: &Path, exts: &[&str]) -> Result<Vec<PathBuf>, String> {
    let mut out = Vec::new();
    walk(dir, &mut |p| {
        if p.is_file()
            && p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| exts.contains(&e))
        {
            out.push(p.to_path_buf());
        }
    })?;
    out.sort();
    Ok(out)
}

fn walk(dir: &Path, f: &mut dyn FnMut(&Path)) -> Result<(), String> {
    if !dir.is_dir() {
        return Ok(());
    }
    let entries = fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        f(&path);
        if path.is_dir() {
            walk(&path, f)?;
        }
    }
    Ok(())
}
