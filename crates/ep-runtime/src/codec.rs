//! Bytes in and out of CPU tensors, and the framing of host-backend messages.

use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// The raw little-endian bytes of a CPU tensor, in row-major order.
pub(crate) fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::BF16 => bytemuck::cast_slice(&t.to_vec1::<half::bf16>()?).to_vec(),
        DType::F16 => bytemuck::cast_slice(&t.to_vec1::<half::f16>()?).to_vec(),
        DType::F32 => bytemuck::cast_slice(&t.to_vec1::<f32>()?).to_vec(),
        DType::F64 => bytemuck::cast_slice(&t.to_vec1::<f64>()?).to_vec(),
        DType::I64 => bytemuck::cast_slice(&t.to_vec1::<i64>()?).to_vec(),
        DType::I32 => bytemuck::cast_slice(&t.to_vec1::<i32>()?).to_vec(),
        DType::U32 => bytemuck::cast_slice(&t.to_vec1::<u32>()?).to_vec(),
        DType::U8 => t.to_vec1::<u8>()?,
        DType::F8E4M3 => bytemuck::cast_slice(&t.to_vec1::<float8::F8E4M3>()?).to_vec(),
        other => {
            return Err(Error::Unsupported(format!(
                "dtype {other:?} cannot be moved by the host backend"
            )))
        }
    })
}

/// A CPU tensor from raw little-endian bytes.
pub(crate) fn tensor_from_bytes(bytes: &[u8], dtype: DType, shape: &[usize]) -> Result<Tensor> {
    Ok(Tensor::from_raw_buffer(bytes, dtype, shape, &Device::Cpu)?)
}

/// Frames several byte sections into one message: `u32 n | n x u64 len | bytes...`.
pub(crate) fn pack(sections: &[&[u8]]) -> Vec<u8> {
    let body: usize = sections.iter().map(|s| s.len()).sum();
    let mut out = Vec::with_capacity(4 + 8 * sections.len() + body);
    out.extend_from_slice(&(sections.len() as u32).to_le_bytes());
    for s in sections {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    }
    for s in sections {
        out.extend_from_slice(s);
    }
    out
}

/// Splits a message framed by [`pack`] into exactly `expected` sections.
pub(crate) fn unpack(msg: &[u8], expected: usize, from: usize) -> Result<Vec<&[u8]>> {
    let bad = |what: String| Error::Protocol { rank: from, what };
    if msg.len() < 4 {
        return Err(bad(format!("message of {} bytes has no header", msg.len())));
    }
    let n = u32::from_le_bytes(msg[..4].try_into().expect("4 bytes")) as usize;
    if n != expected {
        return Err(bad(format!("expected {expected} sections, got {n}")));
    }
    let header = 4 + 8 * n;
    if msg.len() < header {
        return Err(bad("truncated header".into()));
    }
    let mut off = header;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let len =
            u64::from_le_bytes(msg[4 + 8 * i..12 + 8 * i].try_into().expect("8 bytes")) as usize;
        let end = off
            .checked_add(len)
            .filter(|&e| e <= msg.len())
            .ok_or_else(|| bad(format!("section {i} of {len} bytes overruns the message")))?;
        out.push(&msg[off..end]);
        off = end;
    }
    Ok(out)
}

/// Reads a section of little-endian `i32`s.
pub(crate) fn i32s(bytes: &[u8]) -> Vec<i32> {
    bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// Writes `i32`s as little-endian bytes.
pub(crate) fn i32_bytes(v: &[i32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_round_trip_and_bad_messages() {
        let m = pack(&[b"ab", b"", b"cde"]);
        assert_eq!(unpack(&m, 3, 0).unwrap(), vec![&b"ab"[..], b"", b"cde"]);
        assert!(unpack(&m, 2, 5).unwrap_err().to_string().contains("rank 5"));
        assert!(unpack(&m[..m.len() - 1], 3, 0).is_err());
    }

    #[test]
    fn tensor_bytes_round_trip() {
        let t = Tensor::new(&[[1.5f32, -2.0], [3.25, 4.0]], &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let b = tensor_bytes(&t).unwrap();
        let u = tensor_from_bytes(&b, DType::BF16, &[2, 2]).unwrap();
        assert_eq!(
            u.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap(),
            vec![vec![1.5, -2.0], vec![3.25, 4.0]]
        );
    }
}
