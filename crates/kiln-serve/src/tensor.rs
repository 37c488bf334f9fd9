//! Tensors as the server carries them: a datatype, a shape and host values.

use crate::error::{Result, ServeError};

/// Element types kiln-serve accepts and returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataType {
    /// 32-bit float.
    Fp32,
    /// 64-bit signed integer.
    Int64,
}

impl DataType {
    /// The protocol's name (`FP32`).
    pub fn wire_name(self) -> &'static str {
        match self {
            DataType::Fp32 => "FP32",
            DataType::Int64 => "INT64",
        }
    }

    /// Triton's model-config enum value (`TYPE_FP32` = 11, `TYPE_INT64` = 9).
    pub fn config_enum(self) -> i32 {
        match self {
            DataType::Fp32 => 11,
            DataType::Int64 => 9,
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DataType::Fp32 => 4,
            DataType::Int64 => 8,
        }
    }

    /// Parses a protocol name; other protocol types get an error naming what is served.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "FP32" => Ok(DataType::Fp32),
            "INT64" => Ok(DataType::Int64),
            other => Err(ServeError::InvalidRequest(format!(
                "datatype `{other}` is not supported; kiln-serve takes FP32 and INT64"
            ))),
        }
    }
}

/// Host values of one tensor, row-major.
#[derive(Debug, Clone, PartialEq)]
pub enum Values {
    /// FP32 elements.
    F32(Vec<f32>),
    /// INT64 elements.
    I64(Vec<i64>),
}

impl Values {
    /// Element type.
    pub fn datatype(&self) -> DataType {
        match self {
            Values::F32(_) => DataType::Fp32,
            Values::I64(_) => DataType::Int64,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Values::F32(v) => v.len(),
            Values::I64(v) => v.len(),
        }
    }

    /// Bytes of the elements.
    pub fn byte_len(&self) -> usize {
        self.len() * self.datatype().size()
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `len` zeros of `datatype` (a warm-up input).
    pub fn with_len(datatype: DataType, len: usize) -> Self {
        match datatype {
            DataType::Fp32 => Values::F32(vec![0.0; len]),
            DataType::Int64 => Values::I64(vec![0; len]),
        }
    }

    /// Empty values of `datatype` with room for `capacity` elements.
    pub fn with_capacity(datatype: DataType, capacity: usize) -> Self {
        match datatype {
            DataType::Fp32 => Values::F32(Vec::with_capacity(capacity)),
            DataType::Int64 => Values::I64(Vec::with_capacity(capacity)),
        }
    }

    /// Appends `other` (same datatype; checked when the request was decoded).
    pub fn extend_from(&mut self, other: &Values) {
        match (self, other) {
            (Values::F32(a), Values::F32(b)) => a.extend_from_slice(b),
            (Values::I64(a), Values::I64(b)) => a.extend_from_slice(b),
            // Decoding converts every input to the model's datatype, so a batch is uniform.
            _ => unreachable!("a batch mixes datatypes; decode must have converted them"),
        }
    }

    /// Elements `[start, end)` as a new vector.
    pub fn slice(&self, start: usize, end: usize) -> Values {
        match self {
            Values::F32(v) => Values::F32(v[start..end].to_vec()),
            Values::I64(v) => Values::I64(v[start..end].to_vec()),
        }
    }

    /// Little-endian bytes (the protocol's raw and binary encodings).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match self {
            Values::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Values::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// Decodes little-endian bytes of `datatype`; the length must be a whole number of elements.
    pub fn from_le_bytes(datatype: DataType, bytes: &[u8]) -> Result<Values> {
        if !bytes.len().is_multiple_of(datatype.size()) {
            return Err(ServeError::InvalidRequest(format!(
                "{} raw data of {} bytes is not a whole number of {}-byte elements",
                datatype.wire_name(),
                bytes.len(),
                datatype.size()
            )));
        }
        Ok(match datatype {
            DataType::Fp32 => Values::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            DataType::Int64 => Values::I64(
                bytes
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                    .collect(),
            ),
        })
    }
}

/// A model's input or output: name, element type, per-sample shape (no batch dimension).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    /// Tensor name on the wire.
    pub name: String,
    /// Element type.
    pub datatype: DataType,
    /// Per-sample dims.
    pub dims: Vec<usize>,
}

impl TensorSpec {
    /// Elements per sample.
    pub fn sample_len(&self) -> usize {
        self.dims.iter().product()
    }

    /// The protocol's shape: a variable batch dimension (-1) then the per-sample dims.
    pub fn batched_shape(&self) -> Vec<i64> {
        std::iter::once(-1)
            .chain(self.dims.iter().map(|&d| d as i64))
            .collect()
    }
}

/// A named tensor with a batch dimension: what a request carries in and gets back.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    /// Tensor name.
    pub name: String,
    /// Full shape, batch first.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub values: Values,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_bad_lengths_are_errors() {
        let v = Values::F32(vec![1.5, -2.0, 3.25]);
        assert_eq!(
            Values::from_le_bytes(DataType::Fp32, &v.to_le_bytes()).unwrap(),
            v
        );
        let i = Values::I64(vec![i64::MIN, 7]);
        assert_eq!(
            Values::from_le_bytes(DataType::Int64, &i.to_le_bytes()).unwrap(),
            i
        );
        let err = Values::from_le_bytes(DataType::Int64, &[0; 12]).unwrap_err();
        assert!(err.to_string().contains("12 bytes"), "{err}");
        assert_eq!(DataType::Fp32.size(), 4);
        assert_eq!(DataType::Int64.size(), 8);
    }
}
