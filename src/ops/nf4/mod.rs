//! 4-bit weights in bitsandbytes' NF4/FP4 format (the frozen base of QLoRA): quantization,
//! dequantization, and products with activations that read the 4-bit weight directly.
//!
//! - [`format`]: the bit-level definition on the host ([`Packed4`]), exact against bitsandbytes;
//!   [`bnb`] reads a weight as bitsandbytes saves it in HF checkpoints.
//! - [`Quantized4`]: a weight `[n, k]` on the device (packed words, code book, block scales).
//! - [`matmul_4bit`]: `x · Wᵀ` for `x [.., k]`. Up to [`GEMV_MAX_ROWS`] rows a GEMV dequantizes in
//!   registers (on CUDA, half-precision products of up to eight rows on the tensor cores); on
//!   Hopper, half-precision products of up to 1024 rows take a GEMM that makes the weight's MMA
//!   operand in registers; more rows dequantize into a temporary weight and take kiln's GEMM
//!   (cuBLASLt on CUDA). Its backward gives the input gradient only (through the temporary): the
//!   weight is frozen (no gradient, so no optimizer state).

mod backward;
pub mod bnb;
mod cube;
pub mod format;
pub(crate) mod fusion;
pub mod reference;

pub use format::{Absmax, BLOCK_SIZES, FormatError, NESTED_BLOCK, Packed4, QuantType};
pub use kiln_kernels::nf4::GEMV_MAX_ROWS;
#[cfg(feature = "cuda")]
pub(crate) use cube::reads_packed;

use burn::tensor::{
    DType, Int, Shape, Tensor, TensorData,
    backend::Backend,
    ops::{FloatTensor, IntTensor},
};

use super::{prim, wrap};
use crate::error::{ensure, ensure_float};

/// Shape, type and block size of a 4-bit weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout4 {
    /// Output features (rows of the weight).
    pub n: usize,
    /// Input features (columns).
    pub k: usize,
    pub kind: QuantType,
    pub block: usize,
}

impl Layout4 {
    /// Values in the weight (never zero: layouts are checked when built).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        self.n * self.k
    }

    /// Number of absmax blocks.
    pub fn blocks(&self) -> usize {
        self.len().div_ceil(self.block)
    }

    /// Number of packed u32 words.
    pub fn words(&self) -> usize {
        self.len().div_ceil(8)
    }
}

/// The parts of a 4-bit weight, generic over how its int and float tensors are held: Burn
/// tensors ([`Quantized4`]) or backend primitives ([`Quantized4Primitive`]), which the backend
/// traits take.
#[derive(Debug, Clone)]
pub struct Parts4<I, F> {
    /// Packed codes, eight a u32 word (stored as the backend's int).
    pub words: I,
    /// The 16 values of the code book, f32.
    pub code: F,
    pub scales: Scales<I, F>,
    pub layout: Layout4,
}

/// Block scales: f32 absmax per block, or double-quantized.
#[derive(Debug, Clone)]
pub enum Scales<I, F> {
    Absmax(F),
    /// Per block an 8-bit code (four a word), the 256-entry dynamic code book, one f32 scale per
    /// 256 blocks and the offset (`[1]`).
    Nested { codes: I, code: F, absmax: F, offset: F },
}

/// A 4-bit weight on the device.
pub type Quantized4<B> = Parts4<Tensor<B, 1, Int>, Tensor<B, 1>>;
/// A 4-bit weight as backend primitives.
pub type Quantized4Primitive<B> = Parts4<IntTensor<B>, FloatTensor<B>>;

impl<I, F> Parts4<I, F> {
    /// The same weight with each tensor converted.
    pub fn map<I2, F2>(self, mut int: impl FnMut(I) -> I2, mut float: impl FnMut(F) -> F2) -> Parts4<I2, F2> {
        let scales = match self.scales {
            Scales::Absmax(a) => Scales::Absmax(float(a)),
            Scales::Nested { codes, code, absmax, offset } => Scales::Nested { codes: int(codes), code: float(code), absmax: float(absmax), offset: float(offset) },
        };
        Parts4 { words: int(self.words), code: float(self.code), scales, layout: self.layout }
    }

    /// Whether the scales are double-quantized.
    pub fn nested(&self) -> bool {
        matches!(self.scales, Scales::Nested { .. })
    }

    /// Bytes of device memory the weight occupies (codes, scales, code books).
    pub fn bytes(&self) -> usize {
        let l = self.layout;
        let scales = match self.scales {
            Scales::Absmax(_) => 4 * l.blocks(),
            Scales::Nested { .. } => 4 * l.blocks().div_ceil(4) + 4 * 256 + 4 * l.blocks().div_ceil(NESTED_BLOCK) + 4,
        };
        4 * l.words() + 4 * 16 + scales
    }

    /// Bits per weight value, everything included.
    pub fn bits_per_value(&self) -> f64 {
        8.0 * self.bytes() as f64 / self.layout.len() as f64
    }
}

/// Backend support for 4-bit weights. The default methods are the reference.
pub trait Nf4Backend: Backend {
    /// Quantize a `[n, k]` weight with plain f32 absmax scales (double quantization happens on
    /// the host: [`Quantized4::quantize`]).
    fn quantize_4bit(weight: FloatTensor<Self>, kind: QuantType, block: usize) -> Quantized4Primitive<Self> {
        reference::quantize::<Self>(weight, kind, block)
    }

    /// The `[n, k]` float weight in `dtype`.
    fn dequantize_4bit(weight: Quantized4Primitive<Self>, dtype: DType) -> FloatTensor<Self> {
        reference::dequantize::<Self>(weight, dtype)
    }

    /// `x [m, k] · Wᵀ → [m, n]` in the dtype of `x`.
    fn matmul_4bit(x: FloatTensor<Self>, weight: Quantized4Primitive<Self>) -> FloatTensor<Self> {
        reference::matmul::<Self>(x, weight)
    }

    /// `dy [m, n] · W → [m, k]`: the input gradient of [`Nf4Backend::matmul_4bit`].
    fn matmul_4bit_input_grad(dy: FloatTensor<Self>, weight: Quantized4Primitive<Self>) -> FloatTensor<Self> {
        reference::input_grad::<Self>(dy, weight)
    }
}

crate::backend::reference_backends!(Nf4Backend);

impl<B: Backend> Quantized4<B> {
    /// Quantize a float weight `[n, k]` (a `Linear` weight transposed, bitsandbytes' layout).
    /// With `double_quant` the absmax values are double-quantized on the host as bitsandbytes'
    /// `compress_statistics` does (a read-back of `n · k / block` floats: a load-time cost).
    ///
    /// # Panics
    /// If `block` is not one of [`BLOCK_SIZES`] or `n · k` is odd.
    pub fn quantize(weight: Tensor<B, 2>, kind: QuantType, block: usize, double_quant: bool) -> Self
    where
        B: Nf4Backend,
    {
        let [n, k] = weight.dims();
        ensure_float("nf4::quantize", "weight", weight.dtype());
        if let Err(e) = format::check_layout(n * k, &[n, k], block) {
            panic!("{e}");
        }
        let device = weight.device();
        let quantized = B::quantize_4bit(prim(weight), kind, block).map(Tensor::from_primitive, wrap);
        if !double_quant {
            return quantized;
        }
        let Scales::Absmax(absmax) = quantized.scales else { unreachable!("the backends return plain absmax") };
        let values = absmax.into_data().convert::<f32>().into_vec::<f32>().expect("f32 absmax");
        let Parts4 { words, code, layout, .. } = quantized;
        Parts4 { words, code, scales: nested_scales(&Absmax::nested(&values), &device), layout }
    }

    /// Upload a host tensor of two dimensions `[n, k]`.
    pub fn from_host(packed: &Packed4, device: &B::Device) -> Result<Self, FormatError> {
        let &[n, k] = packed.shape.as_slice() else {
            return Err(FormatError(format!("a 4-bit weight needs two dimensions, got shape {:?}", packed.shape)));
        };
        let layout = Layout4 { n, k, kind: packed.kind, block: packed.block };
        let scales = match &packed.absmax {
            Absmax::Plain(v) => Scales::Absmax(floats(v, device)),
            nested => nested_scales(nested, device),
        };
        Ok(Parts4 { words: ints(&packed.words(), device), code: floats(packed.kind.code(), device), scales, layout })
    }

    /// Read the weight back to the host.
    pub fn to_host(&self) -> Packed4 {
        let l = self.layout;
        let words = read_words(self.words.clone());
        let data = format::words_to_bytes(&words, l.len() / 2);
        let absmax = match &self.scales {
            Scales::Absmax(a) => Absmax::Plain(read_floats(a.clone())),
            Scales::Nested { codes, absmax, offset, .. } => Absmax::Nested {
                codes: format::words_to_bytes(&read_words(codes.clone()), l.blocks()),
                absmax: read_floats(absmax.clone()),
                offset: read_floats(offset.clone())[0],
            },
        };
        Packed4 { kind: l.kind, block: l.block, shape: vec![l.n, l.k], data, absmax }
    }

    /// The float weight `[n, k]` in `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Tensor<B, 2>
    where
        B: Nf4Backend,
    {
        ensure_float("nf4::dequantize", "dtype", dtype);
        wrap(B::dequantize_4bit(self.primitive(), dtype))
    }

    /// The backend primitives.
    pub fn primitive(&self) -> Quantized4Primitive<B> {
        self.clone().map(Tensor::into_primitive, prim)
    }

    /// The device the weight lives on.
    pub fn device(&self) -> B::Device {
        self.words.device()
    }
}

/// `x · Wᵀ` for `x [.., k]` and a 4-bit weight `W [n, k]`: `[.., n]` in the dtype of `x`.
///
/// # Panics
/// If the last dimension of `x` is not `k`, or `x` is not a float tensor.
pub fn matmul_4bit<B: Nf4Backend, const D: usize>(x: Tensor<B, D>, weight: &Quantized4<B>) -> Tensor<B, D> {
    let l = weight.layout;
    let dims = x.dims();
    ensure(dims[D - 1] == l.k, "matmul_4bit", || format!("x {dims:?} does not end in the weight's {} input features (weight [{}, {}])", l.k, l.n, l.k));
    ensure_float("matmul_4bit", "x", x.dtype());
    let rows = dims[..D - 1].iter().product::<usize>();
    let x = B::float_reshape(prim(x), Shape::new([rows, l.k]));
    let y = B::matmul_4bit(x, weight.primitive());
    let mut out = dims;
    out[D - 1] = l.n;
    wrap(B::float_reshape(y, Shape::from(out.to_vec())))
}

fn floats<B: Backend>(values: &[f32], device: &B::Device) -> Tensor<B, 1> {
    Tensor::from_data(TensorData::new(values.to_vec(), [values.len()]), (device, DType::F32))
}

fn ints<B: Backend>(words: &[u32], device: &B::Device) -> Tensor<B, 1, Int> {
    let bits: Vec<i32> = words.iter().map(|&w| w as i32).collect();
    Tensor::from_data(TensorData::new(bits, [words.len()]), device)
}

fn nested_scales<B: Backend>(absmax: &Absmax, device: &B::Device) -> Scales<Tensor<B, 1, Int>, Tensor<B, 1>> {
    let Absmax::Nested { codes, absmax, offset } = absmax else { unreachable!("called with nested scales") };
    Scales::Nested {
        codes: ints(&format::bytes_to_words(codes), device),
        code: floats(&format::DYNAMIC_CODE, device),
        absmax: floats(absmax, device),
        offset: floats(&[*offset], device),
    }
}

fn read_words<B: Backend>(t: Tensor<B, 1, Int>) -> Vec<u32> {
    let data = t.into_data().convert::<i64>();
    data.into_vec::<i64>().expect("int words").into_iter().map(|w| w as u32).collect()
}

fn read_floats<B: Backend>(t: Tensor<B, 1>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec::<f32>().expect("f32 scales")
}
