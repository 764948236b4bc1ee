//! 4-bit weights on CubeCL backends: quantization and dequantization kernels, the GEMV for few
//! activation rows, and dequantize-then-GEMM (kiln's `gemm`: cuBLASLt on CUDA) for more rows
//! and for the input gradient.

use burn::tensor::{DType, Shape, TensorData, TensorMetadata, ops::{FloatTensor, FloatTensorOps}};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor};
use kiln_kernels::nf4::{ScaleArgs, gemv_fits, launch_dequantize, launch_gemv, launch_quantize};

use super::{Layout4, Nf4Backend, Parts4, QuantType, Quantized4Primitive, Scales};
use crate::backend::cube::{dense, dense_f32, dense_words, empty_like_device, storage};
use crate::ops::matmul::{GemmLayout, GemmViews, MatmulBackend};

type Weight<R> = Parts4<CubeTensor<R>, CubeTensor<R>>;

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> Nf4Backend for CubeBackend<R, F, I, BT> {
    fn quantize_4bit(weight: FloatTensor<Self>, kind: QuantType, block: usize) -> Quantized4Primitive<Self> {
        let weight = dense(weight);
        let shape = weight.shape();
        let layout = Layout4 { n: shape[0], k: shape[1], kind, block };
        let words = empty_like_device(&weight, [layout.words()], DType::I32);
        let absmax = empty_like_device(&weight, [layout.blocks()], DType::F32);
        let thresholds = host_floats::<R, F, I, BT>(kind.thresholds(), &weight);
        let code = host_floats::<R, F, I, BT>(kind.code(), &weight);
        launch_quantize(
            &weight.client.clone(),
            storage(&weight),
            layout.len(),
            block,
            kind == QuantType::Fp4,
            weight.into_array_arg(),
            thresholds.into_array_arg(),
            words.clone().into_array_arg(),
            absmax.clone().into_array_arg(),
        );
        Parts4 { words, code, scales: Scales::Absmax(absmax), layout }
    }

    fn dequantize_4bit(weight: Quantized4Primitive<Self>, dtype: DType) -> FloatTensor<Self> {
        let weight = dense_parts::<R, F, I, BT>(weight);
        let l = weight.layout;
        let out = empty_like_device(&weight.code, [l.n, l.k], dtype);
        launch_dequantize(
            &out.client.clone(),
            storage(&out),
            l.len(),
            l.block,
            weight.words.clone().into_array_arg(),
            weight.code.clone().into_array_arg(),
            scale_args(&weight),
            out.clone().into_array_arg(),
        );
        out
    }

    fn matmul_4bit(x: FloatTensor<Self>, weight: Quantized4Primitive<Self>) -> FloatTensor<Self> {
        let (m, k, l) = (x.shape()[0], x.shape()[1], weight.layout);
        if !gemv_fits(m, k) {
            let dtype = x.dtype;
            let w = Self::dequantize_4bit(weight, dtype);
            let views = GemmViews::new(Shape::new([1, m, k]), Shape::new([1, l.n, k]), Shape::new([m, l.n]), GemmLayout::new(false, true));
            return Self::gemm(x, w, None, None, views);
        }
        let (x, weight) = (dense(x), dense_parts::<R, F, I, BT>(weight));
        let out = empty_like_device(&x, [m, l.n], x.dtype);
        launch_gemv(
            &x.client.clone(),
            storage(&x),
            m,
            l.n,
            k,
            l.block,
            x.into_array_arg(),
            weight.words.clone().into_array_arg(),
            weight.code.clone().into_array_arg(),
            scale_args(&weight),
            out.clone().into_array_arg(),
        );
        out
    }

    fn matmul_4bit_input_grad(dy: FloatTensor<Self>, weight: Quantized4Primitive<Self>) -> FloatTensor<Self> {
        let (m, l) = (dy.shape()[0], weight.layout);
        let w = Self::dequantize_4bit(weight, dy.dtype);
        let views = GemmViews::new(Shape::new([1, m, l.n]), Shape::new([1, l.n, l.k]), Shape::new([m, l.k]), GemmLayout::default());
        Self::gemm(dy, w, None, None, views)
    }
}

/// Every part dense, the words (and nested codes) in a 32-bit int dtype, which the kernels read
/// as u32 (a backend with 64-bit ints holds the words sign-extended; the cast keeps their low 32
/// bits), and the scales and code books in f32.
fn dense_parts<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(weight: Quantized4Primitive<CubeBackend<R, F, I, BT>>) -> Weight<R> {
    weight.map(dense_words::<R, F, I, BT>, dense_f32::<R, F, I, BT>)
}

/// The kernels' scale bindings: plain absmax fills the unread nested slots.
fn scale_args<R: CubeRuntime>(weight: &Weight<R>) -> ScaleArgs<R> {
    match &weight.scales {
        Scales::Absmax(a) => ScaleArgs {
            absmax: a.clone().into_array_arg(),
            absmax_codes: a.clone().into_array_arg(),
            nested_code: a.clone().into_array_arg(),
            offset: a.clone().into_array_arg(),
            nested: false,
        },
        Scales::Nested { codes, code, absmax, offset } => ScaleArgs {
            absmax: absmax.clone().into_array_arg(),
            absmax_codes: codes.clone().into_array_arg(),
            nested_code: code.clone().into_array_arg(),
            offset: offset.clone().into_array_arg(),
            nested: true,
        },
    }
}

/// An f32 tensor of host `values` on the device of `like`.
fn host_floats<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(values: &[f32], like: &CubeTensor<R>) -> CubeTensor<R> {
    let data = TensorData::new(values.to_vec(), [values.len()]);
    CubeBackend::<R, F, I, BT>::float_from_data(data, &like.device)
}
