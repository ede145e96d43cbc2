//! The kernel entry points of an embedded cubin, read from its ELF symbol table, so that a
//! context can load every kernel before its first op (see [`super::Kernels::get`]).

use object::read::elf::{ElfFile64, Sym as _};
use object::{Endianness, Object, ObjectSymbol, SymbolKind};

use crate::error::{Error, Result};

/// `st_other` bit of a CUDA ELF symbol that marks a kernel entry point (`__global__`), as
/// opposed to a device function.
const STO_CUDA_ENTRY: u8 = 0x10;

/// Names of the kernels (`extern "C" __global__` functions) defined in the cubin `bytes` of
/// `file`: its defined, global function symbols marked as CUDA entry points.
pub(crate) fn entry_points_of(file: &str, bytes: &[u8]) -> Result<Vec<String>> {
    let elf = ElfFile64::<Endianness>::parse(bytes).map_err(|e| {
        Error::invalid(
            "cubin",
            format!("{file:?}"),
            format!("must be an ELF64 cubin ({e})"),
        )
    })?;
    let mut names = Vec::new();
    for sym in elf.symbols() {
        let entry = sym.elf_symbol().st_other().0 & STO_CUDA_ENTRY != 0;
        if sym.kind() == SymbolKind::Text && sym.is_global() && !sym.is_undefined() && entry {
            let name = sym.name().map_err(|e| {
                Error::invalid("cubin", format!("{file:?}"), format!("symbol name: {e}"))
            })?;
            names.push(name.to_owned());
        }
    }
    names.sort();
    Ok(names)
}
