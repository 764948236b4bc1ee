//! Ternary weights on CubeCL backends: the packing and activation kernels, the W2A8 GEMV for
//! few rows (`dp4a` or integer `mma.sync` on CUDA, the portable kernel elsewhere), and for more rows the W2A8 GEMM on
//! Hopper's integer warpgroup MMA, or elsewhere the codes through kiln's GEMM (cuBLASLt's i8 GEMM
//! on other CUDA devices) with the scales applied after. The input gradient runs on Hopper's
//! float warpgroup MMA from the packed weight, elsewhere through kiln's GEMM on the dequantized
//! weight.

use burn::tensor::{DType, Shape, Tensor, TensorMetadata, ops::FloatTensor};
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement, tensor::CubeTensor};
use kiln_kernels::ternary::{ActCodes, ActNorm, GEMV_MAX_ROWS, TILE_BLOCK, launch_dequantize, launch_gemv, launch_quantize_acts, launch_quantize_weight, launch_weight_scales};

use super::format::{WEIGHT_EPS, act_row_words};
use super::{RowNorm, TernaryBackend, TernaryLayout, TernaryParts, TernaryPrimitive};
use crate::ops::rms_norm::RmsNormBackend;
use crate::backend::cube::{dense, dense_f32, dense_words, empty_like_device, storage};
use crate::ops::matmul::{GemmLayout, GemmViews, MatmulBackend};
use crate::ops::{prim, wrap};

type Weight<R> = TernaryParts<CubeTensor<R>, CubeTensor<R>>;

/// An input norm for the activation kernels to apply: `γ` `[k]` and the `rstd` `[m]` they write.
struct Norm<R: CubeRuntime> {
    gamma: CubeTensor<R>,
    rstd: CubeTensor<R>,
    epsilon: f32,
}

impl<R: CubeRuntime> Norm<R> {
    fn arg(&self) -> ActNorm<R> {
        ActNorm::Compute { gamma: self.gamma.clone().into_array_arg(), rstd: self.rstd.clone().into_array_arg(), epsilon: self.epsilon }
    }
}

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> TernaryBackend for CubeBackend<R, F, I, BT> {
    fn ternary_quantize(weight: FloatTensor<Self>, group: usize) -> TernaryPrimitive<Self> {
        let weight = dense(weight);
        let shape = weight.shape();
        let layout = TernaryLayout::new(shape[0], shape[1], group).unwrap_or_else(|e| panic!("{e}"));
        let client = weight.client.clone();
        let scales = empty_like_device(&weight, [layout.groups()], DType::F32);
        let row_sums = empty_like_device(&weight, [layout.n], DType::F32);
        let words = empty_like_device(&weight, [layout.words()], DType::I32);
        let dtype = storage(&weight);
        let weight_arg = || weight.clone().into_array_arg();
        launch_weight_scales(&client, dtype, layout.n, layout.k, layout.group, WEIGHT_EPS, weight_arg(), &row_sums.handle, scales.clone().into_array_arg());
        launch_quantize_weight(&client, dtype, layout.k, layout.row_words(), layout.group, layout.words(), weight_arg(), scales.clone().into_array_arg(), words.clone().into_array_arg());
        TernaryParts { words, scales, layout }
    }

    fn ternary_dequantize(weight: TernaryPrimitive<Self>, dtype: DType) -> FloatTensor<Self> {
        dequantize::<R>(dense_parts::<R, F, I, BT>(weight), dtype, false)
    }

    fn ternary_quantize_acts(x: FloatTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let x = dense(x);
        let [m, k] = dims(&x);
        let codes = empty_like_device(&x, [m, k], x.dtype);
        let scales = empty_like_device(&x, [m], DType::F32);
        launch_quantize_acts(&x.client.clone(), storage(&x), m, k, x.into_array_arg(), scales.clone().into_array_arg(), ActCodes::Float(codes.clone().into_array_arg()), None);
        (codes, scales)
    }

    fn ternary_matmul(x: FloatTensor<Self>, weight: TernaryPrimitive<Self>) -> FloatTensor<Self> {
        let (x, weight) = (dense(x), dense_parts::<R, F, I, BT>(weight));
        if (1..=GEMV_MAX_ROWS).contains(&dims(&x)[0]) {
            return gemv::<R>(x, &weight);
        }
        product::<R, F, I, BT>(x, weight, None)
    }

    fn ternary_matmul_normed(x: FloatTensor<Self>, gamma: FloatTensor<Self>, epsilon: f64, weight: TernaryPrimitive<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let x = dense(x);
        let [m, k] = dims(&x);
        if m <= GEMV_MAX_ROWS || k == 0 {
            // Decoding's few rows: the norm's own kernel, then the GEMV (one `dp4a` kernel for one
            // row, which quantizes in the same launch).
            let normed = Self::rms_norm_forward(x, gamma, None, epsilon);
            return (Self::ternary_matmul(normed.output, weight), normed.rstd);
        }
        let norm = Norm { gamma: dense(gamma), rstd: empty_like_device(&x, [m], DType::F32), epsilon: epsilon as f32 };
        let y = product::<R, F, I, BT>(x, dense_parts::<R, F, I, BT>(weight), Some(&norm));
        (y, norm.rstd)
    }

    fn ternary_input_grad(dy: FloatTensor<Self>, weight: TernaryPrimitive<Self>) -> FloatTensor<Self> {
        let (dy, weight) = (dense(dy), dense_parts::<R, F, I, BT>(weight));
        #[cfg(feature = "cuda")]
        if let Some(dx) = wgmma::input_grad(&dy, &weight) {
            return dx;
        }
        let m = dy.shape()[0];
        let l = weight.layout;
        let w = Self::ternary_dequantize(weight, dy.dtype);
        let views = GemmViews::new(Shape::new([1, m, l.n]), Shape::new([1, l.n, l.k]), Shape::new([m, l.k]), GemmLayout::default());
        Self::gemm(dy, w, None, None, views)
    }

    fn ternary_weight_grad(dy: FloatTensor<Self>, x: FloatTensor<Self>, norm: Option<RowNorm<FloatTensor<Self>>>) -> FloatTensor<Self> {
        let ([m, n], k) = (dims(&dy), x.shape()[1]);
        let dtype = dy.dtype;
        let x_tilde = prim(wrap::<Self, 2>(fake_quantize_acts(dense(x), norm.map(|n| n.map(dense)))).cast(dtype));
        let views = GemmViews::new(Shape::new([1, m, n]), Shape::new([1, m, k]), Shape::new([n, k]), GemmLayout::new(true, false));
        Self::gemm(dy, x_tilde, None, None, views)
    }
}

/// The product of more rows than the GEMV takes, `x` normalized by `norm` in the kernel that
/// quantizes it: on CUDA the Hopper GEMM or cuBLASLt's int8 one; elsewhere the codes in x's
/// dtype (exact: |q| ≤ 128), their integer sums by kiln's GEMM, then the scales.
fn product<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(x: CubeTensor<R>, weight: Weight<R>, norm: Option<&Norm<R>>) -> CubeTensor<R> {
    #[cfg(feature = "cuda")]
    if let Some(y) = wgmma::matmul(&x, &weight, norm).or_else(|| int8::matmul(&x, &weight, norm)) {
        return y;
    }
    let ([m, k], l) = (dims(&x), weight.layout);
    let codes = empty_like_device(&x, [m, k], x.dtype);
    let sx = empty_like_device(&x, [m], DType::F32);
    launch_quantize_acts(&x.client.clone(), storage(&x), m, k, x.clone().into_array_arg(), sx.clone().into_array_arg(), ActCodes::Float(codes.clone().into_array_arg()), norm.map(Norm::arg));
    let w = dequantize::<R>(weight.clone(), x.dtype, true);
    let views = GemmViews::new(Shape::new([1, m, k]), Shape::new([1, l.n, k]), Shape::new([m, l.n]), GemmLayout::new(false, true));
    let acc: Tensor<CubeBackend<R, F, I, BT>, 2> = wrap(CubeBackend::<R, F, I, BT>::gemm(codes, w, None, None, views));
    let sx: Tensor<CubeBackend<R, F, I, BT>, 1> = wrap(sx);
    let sw = row_scales::<R, F, I, BT>(weight.scales, l);
    let scale = sx.reshape([m, 1]) * sw.reshape([1, l.n]);
    prim((acc.cast(burn::tensor::FloatDType::F32) / scale).cast(x.dtype))
}

/// `x [m, k]` (normalized by `norm`, if given) replaced by the values its int8 codes stand for
/// (`q / s` per row, in `x`'s dtype): one kernel, where codes, a cast, a division and a cast back
/// took four passes (and the normalized rows a saved tensor of their own).
fn fake_quantize_acts<R: CubeRuntime>(x: CubeTensor<R>, norm: Option<RowNorm<CubeTensor<R>>>) -> CubeTensor<R> {
    let [m, k] = dims(&x);
    let x_tilde = empty_like_device(&x, [m, k], x.dtype);
    let scales = empty_like_device(&x, [m], DType::F32);
    let norm = norm.map(|n| ActNorm::Given { gamma: n.gamma.into_array_arg(), rstd: n.rstd.into_array_arg() });
    launch_quantize_acts(&x.client.clone(), storage(&x), m, k, x.into_array_arg(), scales.into_array_arg(), ActCodes::Dequantized(x_tilde.clone().into_array_arg()), norm);
    x_tilde
}

fn dims<R: CubeRuntime>(t: &CubeTensor<R>) -> [usize; 2] {
    let s = t.shape();
    [s[0], s[1]]
}

/// The words in a 32-bit int dtype and the scales in f32, both dense.
fn dense_parts<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(weight: TernaryPrimitive<CubeBackend<R, F, I, BT>>) -> Weight<R> {
    weight.map(dense_words::<R, F, I, BT>, dense_f32::<R, F, I, BT>)
}

/// Each output row's scale `[n]` (f32).
fn row_scales<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(scales: CubeTensor<R>, l: TernaryLayout) -> Tensor<CubeBackend<R, F, I, BT>, 1> {
    let scales: Tensor<CubeBackend<R, F, I, BT>, 1> = wrap(scales);
    let groups = l.groups();
    scales.reshape([groups, 1]).expand([groups, l.group]).reshape([groups * l.group]).slice(0..l.n)
}

fn dequantize<R: CubeRuntime>(weight: Weight<R>, dtype: DType, unscaled: bool) -> CubeTensor<R> {
    let l = weight.layout;
    let out = empty_like_device(&weight.scales, [l.n, l.k], dtype);
    launch_dequantize(
        &out.client.clone(),
        storage(&out),
        l.n,
        l.k,
        l.group,
        unscaled,
        weight.words.into_array_arg(),
        weight.scales.into_array_arg(),
        out.clone().into_array_arg(),
    );
    out
}

/// Activation rows `[m, k]` (normalized by `norm`, if given) quantized to int8 codes packed four
/// a word, with their f32 scales and code sums `[m]`: an i8 matrix `[m, act_row_words]` with rows
/// padded to 64, or with `tiled` the Hopper GEMM's layout ([`ActCodes::Tiled`]).
fn packed_acts<R: CubeRuntime>(x: &CubeTensor<R>, tiled: bool, norm: Option<&Norm<R>>) -> [CubeTensor<R>; 3] {
    let [m, k] = dims(x);
    let row_words = if tiled { k.div_ceil(TILE_BLOCK) * TILE_BLOCK / 4 } else { act_row_words(k) };
    let words = empty_like_device(x, [m * row_words], DType::I32);
    let scales = empty_like_device(x, [m], DType::F32);
    let sums = empty_like_device(x, [m], DType::F32);
    let (words_arg, sums_arg) = (words.clone().into_array_arg(), sums.clone().into_array_arg());
    let codes = if tiled { ActCodes::Tiled { words: words_arg, sums: sums_arg } } else { ActCodes::Packed { words: words_arg, sums: sums_arg } };
    launch_quantize_acts(&x.client.clone(), storage(x), m, k, x.clone().into_array_arg(), scales.clone().into_array_arg(), codes, norm.map(Norm::arg));
    [words, scales, sums]
}

/// The GEMV: for one row on CUDA, one `dp4a` kernel that also quantizes the activations (where
/// they fit its shared memory); otherwise activations quantized and packed by one kernel, then
/// on CUDA the `dp4a` kernel (the integer MMA one for 2–8 rows from compute capability 8.0), or
/// the portable one.
fn gemv<R: CubeRuntime>(x: CubeTensor<R>, weight: &Weight<R>) -> CubeTensor<R> {
    let [m, k] = dims(&x);
    let l = weight.layout;
    let client = x.client.clone();
    let out = empty_like_device(&x, [m, l.n], x.dtype);
    #[cfg(feature = "cuda")]
    if dp4a::gemv_fused(&x, m, weight, &out) {
        return out;
    }
    // The code sums serve the `dp4a` kernel only.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    let [words, scales, sums] = packed_acts(&x, false, None);
    #[cfg(feature = "cuda")]
    if dp4a::gemv(&x, m, weight, [&words, &scales, &sums], &out) {
        return out;
    }
    launch_gemv(
        &client,
        storage(&out),
        m,
        l.n,
        k,
        l.group,
        words.into_array_arg(),
        scales.into_array_arg(),
        weight.words.clone().into_array_arg(),
        weight.scales.clone().into_array_arg(),
        out.clone().into_array_arg(),
    );
    out
}

/// Products of more rows on Hopper (compute capability 9.0): the activations quantized and packed
/// by one kernel, then the W2A8 GEMM on the integer warpgroup MMA, which reads the packed weight
/// and writes the scaled output (`kiln_kernels::ternary::wgmma`).
#[cfg(feature = "cuda")]
mod wgmma {
    use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
    use kiln_kernels::ternary::wgmma::{GradArgs, grad_serves, launch_gemm, launch_input_grad, serves};

    use super::dp4a::packed_args;
    use super::{Norm, Weight, dims, packed_acts};
    use crate::backend::cube::cuda::{self, binding};
    use crate::backend::cube::empty_like_device;

    pub(super) fn matmul<R: CubeRuntime>(x: &CubeTensor<R>, weight: &Weight<R>, norm: Option<&Norm<R>>) -> Option<CubeTensor<R>> {
        let client = cuda::client(x)?;
        let kind = cuda::float_kind(x.dtype)?;
        let ([m, k], l, device) = (dims(x), weight.layout, cuda::device_index(x)?);
        if !serves(m, l.n, k) || cuda::compute_capability(device)? != (9, 0) {
            return None;
        }
        let [words, scales, sums] = packed_acts(x, true, norm);
        let out = empty_like_device(x, [m, l.n], x.dtype);
        launch_gemm(client, device, kind, m, l.n, k, l.group, packed_args([&words, &scales, &sums], weight, &out));
        Some(out)
    }

    /// `dy [m, n] · (q / s)` from the packed weight on the float warpgroup MMA, if `dy` is f16 or
    /// bf16 on compute capability 9.0, starts on a 16-byte boundary (its tensor map needs it), and
    /// the kernel takes the shape.
    pub(super) fn input_grad<R: CubeRuntime>(dy: &CubeTensor<R>, weight: &Weight<R>) -> Option<CubeTensor<R>> {
        let client = cuda::client(dy)?;
        let kind = cuda::float_kind(dy.dtype)?;
        let ([m, n], l) = (dims(dy), weight.layout);
        let aligned = dy.handle.offset_start.unwrap_or(0).is_multiple_of(16);
        if !aligned || !grad_serves(kind, m, n, l.k) || cuda::compute_capability(cuda::device_index(dy)?)? != (9, 0) {
            return None;
        }
        let dx = empty_like_device(dy, [m, l.k], dy.dtype);
        let args = GradArgs { dy: binding(dy), words: binding(&weight.words), w_scales: binding(&weight.scales), dx: binding(&dx) };
        launch_input_grad(client, kind, m, n, l.k, l.group, args);
        Some(dx)
    }
}

/// Products of more rows on other CUDA devices' integer tensor cores: the activations' packed int8
/// codes and the weight's codes unpacked to int8 (a temporary of one byte a weight) through
/// cuBLASLt's i8 GEMM (exact i32 sums), then one kernel applies the scales.
#[cfg(feature = "cuda")]
mod int8 {
    use burn::tensor::{DType, Shape};
    use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
    use kiln_kernels::ternary::{launch_rescale, launch_unpack_i8};

    use super::{Norm, Weight, dims, packed_acts};
    use crate::backend::cube::{empty_like_device, storage};
    use crate::ops::matmul::gemm_i8;

    /// `words` (i32 words holding four int8 codes each) seen as a `[1, rows, cols]` i8 matrix.
    fn as_i8<R: CubeRuntime>(words: &CubeTensor<R>, rows: usize, cols: usize) -> CubeTensor<R> {
        CubeTensor::new_contiguous(words.client.clone(), words.device.clone(), Shape::new([1, rows, cols]), words.handle.clone(), DType::I8)
    }

    pub(super) fn matmul<R: CubeRuntime>(x: &CubeTensor<R>, weight: &Weight<R>, norm: Option<&Norm<R>>) -> Option<CubeTensor<R>> {
        crate::backend::cube::cuda::client(x)?;
        let [m, _] = dims(x);
        let l = weight.layout;
        let padded = l.padded_k();
        let client = x.client.clone();
        let [words, scales, _] = packed_acts(x, false, norm);
        let w8 = empty_like_device(x, [l.n * padded / 4], DType::I32);
        launch_unpack_i8(&client, l.words(), weight.words.clone().into_array_arg(), w8.clone().into_array_arg());
        let acc = empty_like_device(x, [1, m, l.n], DType::I32);
        if !gemm_i8(&as_i8(&words, m, padded), &as_i8(&w8, l.n, padded), &acc) {
            return None;
        }
        let out = empty_like_device(x, [m, l.n], x.dtype);
        launch_rescale(
            &client,
            storage(&out),
            m,
            l.n,
            l.group,
            acc.into_array_arg(),
            scales.into_array_arg(),
            weight.scales.clone().into_array_arg(),
            out.clone().into_array_arg(),
        );
        Some(out)
    }
}

#[cfg(feature = "cuda")]
mod dp4a {
    use burn_cubecl::{CubeRuntime, tensor::CubeTensor};
    use cubecl::cuda::CudaRuntime;
    use cubecl::prelude::ComputeClient;
    use kiln_kernels::cuda_source::FloatKind;
    use kiln_kernels::ternary::PackedArgs;
    use kiln_kernels::ternary::dp4a::{FusedArgs, launch_gemv, launch_gemv_fused};

    use super::Weight;
    use crate::backend::cube::cuda::{self, binding};

    /// The bindings of a product on quantized activations (`[words, scales, sums]`), for the
    /// `dp4a` GEMV and the Hopper GEMM.
    pub(super) fn packed_args<R: CubeRuntime>(acts: [&CubeTensor<R>; 3], weight: &Weight<R>, out: &CubeTensor<R>) -> PackedArgs {
        let [words, scales, sums] = acts;
        PackedArgs {
            x: binding(words),
            x_scales: binding(scales),
            x_sums: binding(sums),
            words: binding(&weight.words),
            w_scales: binding(&weight.scales),
            out: binding(out),
        }
    }

    /// The CUDA client and the kernels' element kind for `out`, if `x` lives on a CUDA device
    /// with `dp4a` (compute capability 6.1 and up) and `out` is f32, f16 or bf16.
    fn target<'a, R: CubeRuntime>(x: &'a CubeTensor<R>, out: &CubeTensor<R>) -> Option<(&'a ComputeClient<CudaRuntime>, FloatKind)> {
        let client = cuda::client(x)?;
        let kind = cuda::float_kind(out.dtype)?;
        cuda::capable(x, (6, 1)).then_some((client, kind))
    }

    /// The fused GEMV (float activations quantized in the kernel), if [`target`] allows and
    /// `launch_gemv_fused` takes the shape; `false` enqueues nothing.
    pub(super) fn gemv_fused<R: CubeRuntime>(x: &CubeTensor<R>, m: usize, weight: &Weight<R>, out: &CubeTensor<R>) -> bool {
        let Some((client, kind)) = target(x, out) else { return false };
        let l = weight.layout;
        let args = FusedArgs { x: binding(x), words: binding(&weight.words), w_scales: binding(&weight.scales), out: binding(out) };
        // `x` and `out` share their dtype.
        launch_gemv_fused(client, [kind, kind], m, l.n, l.k, l.group, args)
    }

    /// The CUDA GEMV on quantized activations, if [`target`] allows; `false` leaves the
    /// product to the portable kernel.
    pub(super) fn gemv<R: CubeRuntime>(x: &CubeTensor<R>, m: usize, weight: &Weight<R>, acts: [&CubeTensor<R>; 3], out: &CubeTensor<R>) -> bool {
        let Some((client, kind)) = target(x, out) else { return false };
        let l = weight.layout;
        let args = packed_args(acts, weight, out);
        launch_gemv(client, kind, m, l.n, l.k, l.group, cuda::capable(x, (8, 0)), args);
        true
    }
}
