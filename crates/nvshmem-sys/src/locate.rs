//! Finding NVSHMEM's host library (`libnvshmem_host.so.3`) at run time.
//!
//! Pure Rust, no NVSHMEM needed: [`locate`] walks the folders of [`candidates`] in order and
//! returns the first that holds [`HOST_LIBRARY`]:
//!
//! 1. `NVSHMEM_DIR`, else `NVSHMEM_HOME`: NVSHMEM's prefix (its `lib/`, or the folder itself).
//!    A variable that is set is authoritative: if its folder lacks the library, the search
//!    stops there with [`Error::LibraryNotInDir`] instead of picking up another copy;
//! 2. every entry of `LD_LIBRARY_PATH`;
//! 3. the `nvidia-nvshmem-cu13` wheel in the active environment:
//!    `$VIRTUAL_ENV/lib/python3.*/site-packages/nvidia/nvshmem/lib`, the same under
//!    `$CONDA_PREFIX` and `$HOME/.local`, and `$CONDA_PREFIX/lib`;
//! 4. well-known installs ([`WELL_KNOWN`]): the GPU machine's PyTorch venv
//!    (`/opt/torch/.venv/...`), system Python packages, NVIDIA's Debian packages, `/usr/local`;
//! 5. the `lib/` folder this crate was built against (if it still exists).
//!
//! A `python3.*` component matches every `python3.<minor>` folder. Nothing here runs Python.

use crate::error::{Error, Result, Searched};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The file searched for: NVSHMEM 3's host library.
pub const HOST_LIBRARY: &str = "libnvshmem_host.so.3";

/// NVSHMEM's UID bootstrap plugin, which NVSHMEM loads (by this name, through
/// `libnvshmem_host.so.3`'s `RPATH` of `$ORIGIN`) from the host library's folder unless
/// `NVSHMEM_BOOTSTRAP_UID_PLUGIN` names another file.
pub const UID_PLUGIN: &str = "nvshmem_bootstrap_uid.so.3";

/// Folders where NVSHMEM is commonly installed, searched after the environment's.
pub const WELL_KNOWN: &[&str] = &[
    "/opt/torch/.venv/lib/python3.*/site-packages/nvidia/nvshmem/lib",
    "/usr/local/lib/python3.*/dist-packages/nvidia/nvshmem/lib",
    "/usr/local/lib/python3.*/site-packages/nvidia/nvshmem/lib",
    "/usr/lib/python3/dist-packages/nvidia/nvshmem/lib",
    "/usr/lib/x86_64-linux-gnu/nvshmem/13",
    "/usr/lib/x86_64-linux-gnu/nvshmem/12",
    "/usr/local/nvshmem/lib",
    "/opt/nvidia/nvshmem/lib",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
];

/// The wheel's `lib/` folder under a Python prefix (a venv, conda, `~/.local`).
const WHEEL_UNDER_PREFIX: &str = "lib/python3.*/site-packages/nvidia/nvshmem/lib";

/// What the search looks at: the process environment, captured ([`SearchEnv::from_process`])
/// or made up by a test.
#[derive(Debug, Clone, Default)]
pub struct SearchEnv {
    /// `NVSHMEM_DIR`.
    pub nvshmem_dir: Option<PathBuf>,
    /// `NVSHMEM_HOME`.
    pub nvshmem_home: Option<PathBuf>,
    /// `LD_LIBRARY_PATH`.
    pub ld_library_path: Option<OsString>,
    /// `VIRTUAL_ENV`.
    pub virtual_env: Option<PathBuf>,
    /// `CONDA_PREFIX`.
    pub conda_prefix: Option<PathBuf>,
    /// `HOME`.
    pub home: Option<PathBuf>,
    /// Well-known folders (patterns, see the module docs); [`WELL_KNOWN`] in a real process.
    pub well_known: Vec<PathBuf>,
    /// The NVSHMEM `lib/` folder the crate was built against, if any.
    pub build_lib_dir: Option<PathBuf>,
}

impl SearchEnv {
    /// This process's environment, [`WELL_KNOWN`] and the build-time folder.
    pub fn from_process() -> Self {
        let path = |var: &str| {
            std::env::var_os(var)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        Self {
            nvshmem_dir: path("NVSHMEM_DIR"),
            nvshmem_home: path("NVSHMEM_HOME"),
            ld_library_path: std::env::var_os("LD_LIBRARY_PATH"),
            virtual_env: path("VIRTUAL_ENV"),
            conda_prefix: path("CONDA_PREFIX"),
            home: path("HOME"),
            well_known: WELL_KNOWN.iter().map(PathBuf::from).collect(),
            build_lib_dir: option_env!("NVSHMEM_SYS_BUILD_LIB_DIR").map(PathBuf::from),
        }
    }
}

/// Where the host library was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    /// The folder holding it (canonical).
    pub lib_dir: PathBuf,
    /// `lib_dir/libnvshmem_host.so.3`: the path to `dlopen`.
    pub host_library: PathBuf,
    /// Which rule found it (`NVSHMEM_DIR`, `LD_LIBRARY_PATH`, `well-known`, ...).
    pub from: String,
    /// `lib_dir/nvshmem_bootstrap_uid.so.3`, if it exists.
    pub uid_plugin: Option<PathBuf>,
}

/// Finds [`HOST_LIBRARY`] (see the module docs for the order).
pub fn locate(env: &SearchEnv) -> Result<Located> {
    for (var, value) in [
        ("NVSHMEM_DIR", &env.nvshmem_dir),
        ("NVSHMEM_HOME", &env.nvshmem_home),
    ] {
        if let Some(dir) = value {
            let looked = vec![
                Searched {
                    dir: dir.join("lib"),
                    from: var.to_owned(),
                },
                Searched {
                    dir: dir.clone(),
                    from: var.to_owned(),
                },
            ];
            return find_in(&looked).ok_or_else(|| Error::LibraryNotInDir {
                var,
                dir: dir.clone(),
                file: HOST_LIBRARY,
                looked,
            });
        }
    }
    let searched = candidates(env);
    find_in(&searched).ok_or(Error::LibraryNotFound {
        file: HOST_LIBRARY,
        searched,
    })
}

/// The folders [`locate`] searches when neither `NVSHMEM_DIR` nor `NVSHMEM_HOME` is set, in
/// order, with patterns expanded against the file system and duplicates removed.
pub fn candidates(env: &SearchEnv) -> Vec<Searched> {
    let mut out: Vec<Searched> = Vec::new();
    let mut push = |dir: PathBuf, from: &str| {
        if !out.iter().any(|s| s.dir == dir) {
            out.push(Searched {
                dir,
                from: from.to_owned(),
            });
        }
    };
    if let Some(paths) = &env.ld_library_path {
        for dir in std::env::split_paths(paths).filter(|d| !d.as_os_str().is_empty()) {
            push(dir, "LD_LIBRARY_PATH");
        }
    }
    for (prefix, from) in [
        (&env.virtual_env, "$VIRTUAL_ENV"),
        (&env.conda_prefix, "$CONDA_PREFIX"),
        (&env.home.as_ref().map(|h| h.join(".local")), "$HOME/.local"),
    ] {
        if let Some(prefix) = prefix {
            for dir in expand(&prefix.join(WHEEL_UNDER_PREFIX)) {
                push(dir, from);
            }
        }
    }
    if let Some(prefix) = &env.conda_prefix {
        push(prefix.join("lib"), "$CONDA_PREFIX");
    }
    for pattern in &env.well_known {
        for dir in expand(pattern) {
            push(dir, "well-known");
        }
    }
    if let Some(dir) = &env.build_lib_dir {
        push(dir.clone(), "build-time NVSHMEM_HOME");
    }
    out
}

/// The first folder holding the host library.
fn find_in(dirs: &[Searched]) -> Option<Located> {
    dirs.iter().find_map(|s| {
        let file = s.dir.join(HOST_LIBRARY);
        if !file.is_file() {
            return None;
        }
        let host_library = std::fs::canonicalize(&file).unwrap_or(file);
        let lib_dir = host_library
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| s.dir.clone());
        let plugin = lib_dir.join(UID_PLUGIN);
        Some(Located {
            uid_plugin: plugin.is_file().then_some(plugin),
            lib_dir,
            host_library,
            from: s.from.clone(),
        })
    })
}

/// The folders matching `pattern`, where a component ending in `*` matches every entry of its
/// parent that starts with the rest (sorted); a pattern without `*` is returned as is.
fn expand(pattern: &Path) -> Vec<PathBuf> {
    let mut found = vec![PathBuf::new()];
    for component in pattern.components() {
        let part = component.as_os_str().to_string_lossy();
        match part.strip_suffix('*') {
            None => found.iter_mut().for_each(|p| p.push(component)),
            Some(prefix) => {
                let mut next = Vec::new();
                for base in &found {
                    let Ok(entries) = std::fs::read_dir(base) else {
                        continue;
                    };
                    let mut names: Vec<PathBuf> = entries
                        .filter_map(|e| e.ok())
                        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
                        .map(|e| e.path())
                        .collect();
                    names.sort();
                    next.extend(names);
                }
                found = next;
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// Makes `dir/libnvshmem_host.so.3` (and optionally the UID plugin) under a temp folder.
    fn install(root: &Path, rel: &str, plugin: bool) -> PathBuf {
        let dir = root.join(rel);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(HOST_LIBRARY), b"not really ELF").unwrap();
        if plugin {
            fs::write(dir.join(UID_PLUGIN), b"").unwrap();
        }
        fs::canonicalize(dir).unwrap()
    }

    #[test]
    fn nvshmem_dir_prefix_and_lib_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let lib = install(tmp.path(), "nvshmem/lib", true);
        let env = SearchEnv {
            nvshmem_dir: Some(tmp.path().join("nvshmem")),
            ..SearchEnv::default()
        };
        let found = locate(&env).unwrap();
        assert_eq!(found.lib_dir, lib);
        assert_eq!(found.host_library, lib.join(HOST_LIBRARY));
        assert_eq!(found.uid_plugin, Some(lib.join(UID_PLUGIN)));
        assert_eq!(found.from, "NVSHMEM_DIR");
        // The lib/ folder itself works too.
        let env = SearchEnv {
            nvshmem_dir: Some(lib.clone()),
            ..SearchEnv::default()
        };
        assert_eq!(locate(&env).unwrap().lib_dir, lib);
    }

    #[test]
    fn a_set_variable_is_authoritative() {
        let tmp = tempfile::tempdir().unwrap();
        let elsewhere = install(tmp.path(), "elsewhere", false);
        let env = SearchEnv {
            nvshmem_dir: Some(tmp.path().join("empty")),
            ld_library_path: Some(elsewhere.clone().into_os_string()),
            ..SearchEnv::default()
        };
        let err = locate(&env).unwrap_err();
        assert!(
            matches!(&err, Error::LibraryNotInDir { var: "NVSHMEM_DIR", looked, .. } if looked.len() == 2),
            "{err:?}"
        );
        let msg = err.to_string();
        for part in [
            "NVSHMEM_DIR=",
            "empty",
            HOST_LIBRARY,
            "empty/lib",
            "nvidia-nvshmem-cu13",
        ] {
            assert!(msg.contains(part), "missing {part:?} in: {msg}");
        }
        // NVSHMEM_DIR wins over NVSHMEM_HOME; NVSHMEM_HOME is used when NVSHMEM_DIR is unset.
        let home = install(tmp.path(), "home/lib", false);
        let env = SearchEnv {
            nvshmem_home: Some(tmp.path().join("home")),
            ..SearchEnv::default()
        };
        let found = locate(&env).unwrap();
        assert_eq!((found.lib_dir, found.from.as_str()), (home, "NVSHMEM_HOME"));
        let env = SearchEnv {
            nvshmem_dir: Some(elsewhere.clone()),
            nvshmem_home: Some(tmp.path().join("home")),
            ..SearchEnv::default()
        };
        assert_eq!(locate(&env).unwrap().lib_dir, elsewhere);
    }

    #[test]
    fn ld_library_path_in_order_before_wheels() {
        let tmp = tempfile::tempdir().unwrap();
        let second = install(tmp.path(), "second", false);
        let third = install(tmp.path(), "third", false);
        let venv = install(
            tmp.path(),
            "venv/lib/python3.12/site-packages/nvidia/nvshmem/lib",
            false,
        );
        let paths = std::env::join_paths([
            tmp.path().join("first"),
            PathBuf::new(),
            second.clone(),
            third,
        ])
        .unwrap();
        let env = SearchEnv {
            ld_library_path: Some(paths),
            virtual_env: Some(tmp.path().join("venv")),
            ..SearchEnv::default()
        };
        let found = locate(&env).unwrap();
        assert_eq!(
            (found.lib_dir, found.from.as_str()),
            (second, "LD_LIBRARY_PATH")
        );
        assert_eq!(found.uid_plugin, None);
        let env = SearchEnv {
            virtual_env: Some(tmp.path().join("venv")),
            ..SearchEnv::default()
        };
        let found = locate(&env).unwrap();
        assert_eq!((found.lib_dir, found.from.as_str()), (venv, "$VIRTUAL_ENV"));
    }

    #[test]
    fn python_versions_and_well_known_patterns_expand() {
        let tmp = tempfile::tempdir().unwrap();
        let lib = install(
            tmp.path(),
            "opt/.venv/lib/python3.11/site-packages/nvidia/nvshmem/lib",
            true,
        );
        fs::create_dir_all(tmp.path().join("opt/.venv/lib/python3.10")).unwrap();
        fs::create_dir_all(tmp.path().join("opt/.venv/lib/other")).unwrap();
        let pattern = tmp
            .path()
            .join("opt/.venv/lib/python3.*/site-packages/nvidia/nvshmem/lib");
        let env = SearchEnv {
            well_known: vec![pattern.clone()],
            ..SearchEnv::default()
        };
        let dirs: Vec<PathBuf> = candidates(&env).into_iter().map(|s| s.dir).collect();
        let base = tmp.path().join("opt/.venv/lib");
        assert_eq!(
            dirs,
            [
                base.join("python3.10/site-packages/nvidia/nvshmem/lib"),
                base.join("python3.11/site-packages/nvidia/nvshmem/lib"),
            ]
        );
        let found = locate(&env).unwrap();
        assert_eq!((found.lib_dir, found.from.as_str()), (lib, "well-known"));
        // A pattern whose wildcard matches nothing yields no folder.
        assert!(expand(&tmp.path().join("nowhere/python3.*/lib")).is_empty());
    }

    #[test]
    fn nothing_found_names_every_folder_and_the_variable() {
        let tmp = tempfile::tempdir().unwrap();
        fs::create_dir_all(tmp.path().join("venv/lib/python3.12")).unwrap();
        let env = SearchEnv {
            ld_library_path: Some(tmp.path().join("ld").into_os_string()),
            virtual_env: Some(tmp.path().join("venv")),
            conda_prefix: Some(tmp.path().join("conda")),
            well_known: vec![tmp.path().join("wk")],
            build_lib_dir: Some(tmp.path().join("build")),
            ..SearchEnv::default()
        };
        let err = locate(&env).unwrap_err();
        let Error::LibraryNotFound { file, searched } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(*file, HOST_LIBRARY);
        let from: Vec<&str> = searched.iter().map(|s| s.from.as_str()).collect();
        assert_eq!(
            from,
            [
                "LD_LIBRARY_PATH",
                "$VIRTUAL_ENV",
                "$CONDA_PREFIX",
                "well-known",
                "build-time NVSHMEM_HOME"
            ]
        );
        let msg = err.to_string();
        for part in [
            HOST_LIBRARY,
            "NVSHMEM_DIR",
            "LD_LIBRARY_PATH",
            "/ld (LD_LIBRARY_PATH)",
            "python3.12/site-packages/nvidia/nvshmem/lib ($VIRTUAL_ENV)",
            "/wk (well-known)",
            "/build (build-time NVSHMEM_HOME)",
        ] {
            assert!(msg.contains(part), "missing {part:?} in: {msg}");
        }
        // With nothing at all to search, the message says so.
        let msg = locate(&SearchEnv::default()).unwrap_err().to_string();
        assert!(msg.contains("searched: nothing"), "{msg}");
    }

    #[test]
    fn duplicates_are_searched_once() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("same");
        let env = SearchEnv {
            ld_library_path: Some(std::env::join_paths([&dir, &dir]).unwrap()),
            well_known: vec![dir.clone()],
            build_lib_dir: Some(dir.clone()),
            ..SearchEnv::default()
        };
        assert_eq!(candidates(&env).len(), 1);
    }

    #[test]
    fn the_process_environment_is_read() {
        let env = SearchEnv::from_process();
        assert_eq!(env.well_known.len(), WELL_KNOWN.len());
        assert_eq!(
            env.nvshmem_dir,
            std::env::var_os("NVSHMEM_DIR")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        );
    }
}
