//! Loading NVSHMEM and the embedded shim, without a GPU (`cuda` feature; runs on the CPU
//! machine with `eval "$(scripts/cuda-toolchain.sh)"`, whose `NVSHMEM_HOME` the search finds).
//!
//! One test function: the steps depend on the process's state (nothing loaded, then loaded).

use nvshmem_sys::{cuda_device_count, library_loaded, Error, Nvshmem, UniqueId, UNIQUE_ID_VERSION};

#[test]
fn load_make_an_id_and_fail_init_cleanly() {
    // Bad arguments are rejected before NVSHMEM is loaded.
    let mut bytes = [0u8; 128];
    bytes[..4].copy_from_slice(&UNIQUE_ID_VERSION.to_le_bytes());
    let fake = UniqueId::from_bytes(&bytes).unwrap();
    let err = Nvshmem::init(0, 0, &fake, 0).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { name: "nranks", .. }),
        "{err}"
    );
    let err = Nvshmem::init(3, 3, &fake, 0).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { name: "rank", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("must be < nranks = 3"), "{err}");
    let err = Nvshmem::init(0, 1, &fake, usize::MAX).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { name: "device", .. }),
        "{err}"
    );
    assert!(!library_loaded());

    // A unique id needs NVSHMEM's host library and its UID plugin, but no GPU.
    std::env::set_var("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo");
    let id = match UniqueId::new() {
        Ok(id) => id,
        Err(e @ (Error::LibraryNotFound { .. } | Error::LibraryNotInDir { .. })) => {
            eprintln!("NVSHMEM not found here, nothing more to check: {e}");
            return;
        }
        Err(e) => panic!("UniqueId::new: {e}"),
    };
    assert!(library_loaded());
    assert_eq!(UniqueId::from_hex(&id.to_hex()).unwrap(), id);
    let other = UniqueId::new().unwrap();
    assert_ne!(id, other, "two ids share their listener and magic");

    // Without a GPU (or a driver), init fails with a CUDA error before NVSHMEM is called, and
    // leaves the process able to try again.
    match cuda_device_count() {
        Ok(n) if n > 0 => eprintln!("{n} CUDA devices: this test does not init NVSHMEM"),
        Ok(_) => {
            let err = Nvshmem::init(0, 1, &id, 0).unwrap_err();
            assert!(
                matches!(err, Error::InvalidArgument { name: "device", .. }),
                "{err}"
            );
        }
        Err(e) => {
            assert!(matches!(e, Error::Cuda { .. }), "{e}");
            assert!(e.to_string().contains("cudaGetDeviceCount"), "{e}");
            for _ in 0..2 {
                let err = Nvshmem::init(0, 1, &id, 0).unwrap_err();
                assert!(matches!(err, Error::Cuda { .. }), "{err}");
            }
        }
    }
}
